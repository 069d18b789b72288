"""Soak test: a mixed load against a live OpenAI-compatible server for a fixed time, then a leak check.

    python -m bench.soak --base-url http://127.0.0.1:8000 --duration 600 --pid <server pid>

``--concurrency`` workers send requests back to back until ``--duration`` seconds have passed. Each
request is one scenario, drawn at random (seeded): short and long prompts, completions and chat,
streaming and not, ``n`` of 1 or 2, cancellations (a stream dropped after a few events, a
non-streaming client that gives up), beam searches (``use_beam_search`` with ``best_of`` beams, both
endpoints, non-streaming, some given up), prompt lookup on repeated text (``prompt_lookup_num_tokens``: it
speculates on any server, and the model repeating the phrase accepts its drafts), and constrained outputs
(bench/soak_constrained.py: JSON-schema, regex and forced tool-call requests, streamed and not, and
constrained streams dropped early).
``--scenarios`` runs a subset. Every request is bounded in time.

Counted: requests accepted (2xx), refused by admission control (429 or 503, not failures), and failed:
an accepted request that did not complete (a 5xx, an unexpected 4xx, an error event in its stream, a
stream without ``[DONE]``, a wrong token count, a constrained output that does not match its constraint,
a transport error). Cancelled requests are the client's choice and count as cancelled.

At the end: the server must return to idle (``cbserve:kv_cache_usage_perc`` 0, nothing running or
waiting, no grammar matcher held, on /metrics) within ``--idle-timeout`` seconds, else a block or a
matcher leaked. The summary also gives the speculative decoding counters' change over the run (drafts,
draft tokens, accepted tokens: 0 when nothing speculated). With ``--pid``, the server's
resident memory (``VmRSS`` of ``/proc/PID/status``) is sampled every second; growth is measured from
the end of the warm-up (the first 10% of the run) to the end: the median of the samples in the 10% of
the run after warm-up against the median of the last 10%.

Exit status: 0 when clean; 1 on a failed accepted request, a leaked block, or RSS growth >= ``--max-rss-growth``
(5%); 2 when the server cannot be reached. A JSON summary goes to stdout (and ``--output``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.soak_constrained import CONSTRAINED_SCENARIOS, check_answer, check_stream, constrained_request

WARMUP_FRACTION = 0.1
REQUEST_TIMEOUT_S = 120.0
SCENARIOS: dict[str, float] = {  # scenario -> weight
    "completion-short": 3,
    "completion-long-stream": 2,
    "completion-n2": 1,
    "chat-stream": 2,
    "chat-n2": 1,
    "cancel-stream": 2,
    "cancel-non-stream": 1,
    "beam-search": 2,
    "cancel-beam-search": 1,
    "lookup-stream": 2,
    "lookup-n2": 1,
    "cancel-lookup-stream": 1,
    **CONSTRAINED_SCENARIOS,
}
CANCELLED_BY_TIMEOUT = ("cancel-non-stream", "cancel-beam-search")
IDLE_GAUGES = (
    "cbserve:kv_cache_usage_perc",
    "cbserve:num_requests_running",
    "cbserve:num_requests_waiting",
    "cbserve:num_grammar_matchers",
)
SPEC_COUNTERS = (
    "cbserve:spec_decode_num_drafts_total",
    "cbserve:spec_decode_num_draft_tokens_total",
    "cbserve:spec_decode_num_accepted_tokens_total",
)
PROMPT_LOOKUP_TOKENS = 4
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly hex an old jukebox "
    "near the river bank where children play and merchants sell bread cheese apples and wine"
).split()


@dataclass
class Tally:
    accepted: int = 0
    refused: int = 0
    cancelled: int = 0
    failed: int = 0
    by_scenario: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def fail(self, scenario: str, reason: str) -> None:
        self.failed += 1
        if len(self.failures) < 20:
            self.failures.append(f"{scenario}: {reason}")


@dataclass(frozen=True)
class SoakConfig:
    base_url: str
    duration: float
    concurrency: int
    max_model_len: int
    headers: dict[str, str]
    seed: int
    scenarios: tuple[str, ...] = tuple(SCENARIOS)

    def __post_init__(self) -> None:
        unknown = set(self.scenarios) - set(SCENARIOS)
        if unknown or not self.scenarios:
            raise ValueError(f"--scenarios: unknown {sorted(unknown)} (known: {', '.join(SCENARIOS)})")
        if self.duration <= 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration}")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.max_model_len < 64:
            raise ValueError(f"the server's max_model_len {self.max_model_len} is too small for the soak mix")


def prompt_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def repeated_text(rng: random.Random) -> str:
    """A phrase said three times and begun a fourth: prompt lookup finds its continuation in the prompt."""
    phrase = prompt_text(rng, rng.randint(6, 12)) + "."
    return " ".join([phrase] * 3 + phrase.split()[: rng.randint(1, 4)])


def beam_request(rng: random.Random, common: dict[str, Any], text: str) -> tuple[str, dict[str, Any]]:
    """A non-streaming beam search (beams cannot stream) on either endpoint: the ``n`` best of ``best_of``."""
    best_of = rng.randint(2, 4)
    body = {**common, "use_beam_search": True, "best_of": best_of, "n": rng.randint(1, min(2, best_of))}
    body |= {"max_tokens": rng.randint(4, 24), "length_penalty": rng.choice([0.5, 1.0, 2.0])}
    body["early_stopping"] = rng.choice([True, False, "never"])
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": text}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}


def build_request(rng: random.Random, scenario: str, max_model_len: int) -> tuple[str, dict[str, Any]]:
    """(path, body) of one request of ``scenario``; prompt + max_tokens always fit the context."""
    if scenario in CONSTRAINED_SCENARIOS:
        return constrained_request(rng, scenario)
    # ~1.3 tokens a word: about half the context, at most ~400 tokens (a CPU server must keep up)
    long_words = max(16, min(300, max_model_len // 3))
    common: dict[str, Any] = {
        "temperature": rng.choice([0, 0.8]),
        "ignore_eos": True,
        "seed": rng.randrange(2**31),
    }
    if scenario == "completion-short":
        return "/v1/completions", {**common, "prompt": prompt_text(rng, 8), "max_tokens": rng.randint(4, 32)}
    if scenario == "completion-long-stream":
        body = {**common, "prompt": prompt_text(rng, long_words), "max_tokens": rng.randint(8, 48)}
        return "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    if scenario == "completion-n2":
        return "/v1/completions", {**common, "prompt": prompt_text(rng, 20), "max_tokens": 16, "n": 2}
    messages = [{"role": "user", "content": prompt_text(rng, rng.randint(5, 60))}]
    if scenario == "chat-stream":
        body = {**common, "messages": messages, "max_tokens": rng.randint(8, 48), "stream": True}
        return "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
    if scenario == "chat-n2":
        return "/v1/chat/completions", {**common, "messages": messages, "max_tokens": 16, "n": 2}
    if scenario == "cancel-stream":
        return "/v1/completions", {
            **common,
            "prompt": prompt_text(rng, 30),
            "max_tokens": 200,
            "stream": True,
        }
    if scenario == "cancel-non-stream":
        return "/v1/chat/completions", {**common, "messages": messages, "max_tokens": 200}
    if scenario == "beam-search":
        return beam_request(rng, common, prompt_text(rng, rng.randint(5, 40)))
    if scenario == "cancel-beam-search":
        path, body = beam_request(rng, common, prompt_text(rng, rng.randint(5, 40)))
        return path, {**body, "max_tokens": 200}
    lookup = {**common, "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS, "prompt": repeated_text(rng)}
    if scenario == "lookup-stream":
        body = {**lookup, "max_tokens": rng.randint(16, 48), "stream": True}
        return "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    if scenario == "lookup-n2":
        return "/v1/completions", {**lookup, "max_tokens": 24, "n": 2}
    if scenario == "cancel-lookup-stream":
        return "/v1/completions", {**lookup, "max_tokens": 200, "stream": True}
    raise ValueError(f"unknown scenario {scenario!r}")


def expected_tokens(body: dict[str, Any]) -> int:
    """Completion tokens an uncancelled request must report (``ignore_eos``: exactly max_tokens each)."""
    return int(body["max_tokens"]) * int(body.get("n", 1))


def check_json_answer(body: dict[str, Any], answer: dict[str, Any]) -> str | None:
    """What is wrong with a whole non-streamed answer (None: nothing): its constraint, or its length."""
    if not body.get("ignore_eos"):
        return check_answer(body, answer)
    if len(answer["choices"]) != int(body.get("n", 1)):
        return f"{len(answer['choices'])} choices for n = {body.get('n', 1)}"
    if answer["usage"]["completion_tokens"] != expected_tokens(body):
        return f"completion_tokens {answer['usage']['completion_tokens']} != {expected_tokens(body)}"
    return None


async def run_stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], cut_after: int | None
) -> tuple[int, str | None]:
    """(status, failure or None) of one streamed request; ``cut_after`` events, then hang up."""
    chunks: list[dict[str, Any]] = []
    usage: dict[str, Any] | None = None
    done = False
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, resp.text[:200]
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                return 200, f"error event {event['error']}"
            usage = event.get("usage") or usage
            chunks.append(event)
            if cut_after is not None and len(chunks) >= cut_after:
                return 200, None
    if not done:
        return 200, "stream ended without [DONE]"
    if not body.get("ignore_eos"):
        return 200, check_stream(body, chunks)
    if usage is not None and usage["completion_tokens"] != expected_tokens(body):
        return 200, f"completion_tokens {usage['completion_tokens']} != {expected_tokens(body)}"
    return 200, None


async def one_request(client: httpx.AsyncClient, rng: random.Random, cfg: SoakConfig, tally: Tally) -> None:
    scenario = rng.choices(cfg.scenarios, weights=[SCENARIOS[s] for s in cfg.scenarios])[0]
    path, body = build_request(rng, scenario, cfg.max_model_len)
    tally.by_scenario[scenario] += 1
    try:
        if scenario in CANCELLED_BY_TIMEOUT:
            try:
                resp = await client.post(path, json=body, timeout=rng.uniform(0.2, 1.5))
            except httpx.TimeoutException:
                tally.cancelled += 1
                return
            status = resp.status_code
            failure = check_json_answer(body, resp.json()) if status == 200 else resp.text[:200]
        elif body.get("stream"):
            cancel = scenario.startswith("cancel-")
            cut = rng.randint(0, 20) if cancel else None
            status, failure = await run_stream(client, path, body, cut)
            if cancel and status == 200 and failure is None:
                tally.accepted += 1
                tally.cancelled += 1
                return
        else:
            resp = await client.post(path, json=body)
            status = resp.status_code
            failure = check_json_answer(body, resp.json()) if status == 200 else resp.text[:200]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        tally.fail(scenario, f"{type(exc).__name__}: {exc}")
        return
    if status in (429, 503):
        tally.refused += 1
        return
    if status == 200:
        tally.accepted += 1
    if failure is not None:
        tally.fail(scenario, f"status {status}: {failure}")


async def load(cfg: SoakConfig, tally: Tally) -> None:
    deadline = time.monotonic() + cfg.duration
    master = random.Random(cfg.seed)
    limits = httpx.Limits(max_connections=cfg.concurrency * 2)
    async with httpx.AsyncClient(
        base_url=cfg.base_url, headers=cfg.headers, timeout=REQUEST_TIMEOUT_S, limits=limits
    ) as client:

        async def worker(rng: random.Random) -> None:
            while time.monotonic() < deadline:
                await one_request(client, rng, cfg, tally)

        await asyncio.gather(*(worker(random.Random(master.random())) for _ in range(cfg.concurrency)))


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


async def sample_rss(pid: int, samples: list[tuple[float, int]], stop: asyncio.Event) -> None:
    start = time.monotonic()
    while not stop.is_set():
        value = rss_kib(pid)
        if value is not None:
            samples.append((time.monotonic() - start, value))
        try:
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        except TimeoutError:
            pass


def rss_growth(samples: list[tuple[float, int]], duration: float) -> dict[str, float] | None:
    """Median RSS just after warm-up vs over the last 10% of the run, and the growth in percent."""
    warm_end = WARMUP_FRACTION * duration
    after_warmup = [v for t, v in samples if warm_end <= t < warm_end + 0.1 * duration]
    last = [v for t, v in samples if t >= 0.9 * duration]
    if not after_warmup or not last:
        return None
    base, end = statistics.median(after_warmup), statistics.median(last)
    return {
        "rss_after_warmup_mib": base / 1024,
        "rss_end_mib": end / 1024,
        "growth_pct": 100 * (end - base) / base,
    }


def metric_sums(base_url: str, headers: dict[str, str], names: tuple[str, ...]) -> dict[str, float]:
    """Each of ``names`` on /metrics, summed over its labels (absent: left out)."""
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def engine_gauges(base_url: str, headers: dict[str, str]) -> dict[str, float]:
    return metric_sums(base_url, headers, IDLE_GAUGES)


def speculation_since(base_url: str, headers: dict[str, str], before: dict[str, float]) -> dict[str, float]:
    """How much each speculative decoding counter grew since ``before`` (drafts, draft and accepted tokens)."""
    now = metric_sums(base_url, headers, SPEC_COUNTERS)
    return {
        name.removeprefix("cbserve:spec_decode_num_").removesuffix("_total"): now.get(name, 0.0)
        - before.get(name, 0.0)
        for name in SPEC_COUNTERS
    }


def wait_idle(base_url: str, headers: dict[str, str], timeout: float) -> dict[str, float]:
    """The gauges once all are 0, or the last ones seen after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = engine_gauges(base_url, headers)
        if (len(gauges) == len(IDLE_GAUGES) and not any(gauges.values())) or time.monotonic() >= deadline:
            return gauges
        time.sleep(0.25)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--pid", type=int, default=None, help="the server's process id, to sample its RSS")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--scenarios",
        type=lambda text: tuple(s.strip() for s in text.split(",") if s.strip()),
        default=tuple(SCENARIOS),
        help=f"comma-separated subset of the mix (default all: {', '.join(SCENARIOS)})",
    )
    p.add_argument("--idle-timeout", type=float, default=30.0, help="seconds for the server to go idle")
    p.add_argument("--max-rss-growth", type=float, default=5.0, help="percent of RSS growth that fails")
    p.add_argument("--output", type=Path, default=None, help="also write the JSON summary here")
    return p


async def soak(cfg: SoakConfig, pid: int | None) -> tuple[Tally, list[tuple[float, int]]]:
    tally = Tally()
    samples: list[tuple[float, int]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(pid, samples, stop)) if pid is not None else None
    try:
        await load(cfg, tally)
    finally:
        stop.set()
        if sampler is not None:
            await sampler
    return tally, samples


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        models = (
            httpx.get(args.base_url + "/v1/models", headers=headers, timeout=10).raise_for_status().json()
        )
        max_model_len = int(models["data"][0].get("max_model_len") or 2048)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"error: cannot reach {args.base_url}: {exc}", file=sys.stderr)
        return 2
    if args.pid is not None and rss_kib(args.pid) is None:
        print(f"error: no /proc/{args.pid}/status: is --pid the server's process id?", file=sys.stderr)
        return 2
    try:
        cfg = SoakConfig(
            args.base_url, args.duration, args.concurrency, max_model_len, headers, args.seed, args.scenarios
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    spec_before = metric_sums(args.base_url, headers, SPEC_COUNTERS)
    started = time.monotonic()
    tally, samples = asyncio.run(soak(cfg, args.pid))
    elapsed = time.monotonic() - started
    gauges = wait_idle(args.base_url, headers, args.idle_timeout)
    leaked = len(gauges) != len(IDLE_GAUGES) or any(gauges.values())
    growth = rss_growth(samples, elapsed) if args.pid is not None else None
    speculation = speculation_since(args.base_url, headers, spec_before)
    summary: dict[str, Any] = {
        "duration_s": round(elapsed, 1),
        "concurrency": args.concurrency,
        "requests": sum(tally.by_scenario.values()),
        "accepted": tally.accepted,
        "refused": tally.refused,
        "cancelled": tally.cancelled,
        "failed": tally.failed,
        "by_scenario": dict(tally.by_scenario),
        "failures": tally.failures,
        "idle_gauges": gauges,
        "leaked_blocks": leaked,
        "speculation": speculation,
        "rss": growth,
    }
    print(json.dumps(summary, indent=2))
    if args.output is not None:
        args.output.write_text(json.dumps(summary, indent=2) + "\n")
    problems = []
    if tally.failed:
        problems.append(f"{tally.failed} accepted request(s) failed")
    if leaked:
        problems.append(f"the server did not return to idle: {gauges}")
    if args.pid is not None and growth is None:
        problems.append("too few RSS samples to measure growth (run longer)")
    if growth is not None and growth["growth_pct"] >= args.max_rss_growth:
        problems.append(f"RSS grew {growth['growth_pct']:.1f}% after warm-up (limit {args.max_rss_growth}%)")
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
