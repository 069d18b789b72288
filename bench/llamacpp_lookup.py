"""llama.cpp's own speculative decoding (its server's n-gram lookup) on bench.speculative's grounded workload.

    python -m bench.llamacpp_lookup --llama-dir /tmp/llamacpp/build/bin

The peer of ``python -m bench.speculative --num-seqs 1 --workloads grounded --systems ngram``: the same
three grounded prompts (fix the typos of a paragraph, add type hints to code, quote a passage), chat-templated
by cbserve's tokenizer and sent to ``llama-server``'s ``/completion`` as token ids (so both read the very same
prompt tokens), one after another (a single stream), greedy, ``--new-tokens`` each, EOS kept, on the default
model's GGUF (SmolLM2-135M-Instruct Q4_1, ``engine.loader.source.default_gguf_path``).

llama.cpp speculates server-wide (``--spec-type``), so each system is its own ``llama-server`` process,
started, warmed up with one short request, measured and stopped, in turn inside every round:

- ``plain``: no speculation.
- ``ngram-simple-K``: the nearest llama.cpp mode to cbserve's ``ngram``: the last ``N = --ngram-size`` tokens
  (3: cbserve looks up the longest match of its last 1-3) looked up in the sequence's prompt and output, the
  ``K = --num-speculative-tokens`` tokens after the latest match drafted (``--spec-type ngram-simple
  --spec-ngram-simple-size-n N --spec-ngram-simple-size-m K``).
- ``ngram-simple``, ``ngram-map-k``, ``ngram-mod``: those modes with the version's defaults (a 12-token key,
  drafts of up to 48 tokens; ngram-mod: a 24-token key, drafts of 48-64).
- ``ngram-cache``: the n-gram cache of llama.cpp's ``llama-lookup`` example (keys of 1-4 tokens, drafts of 8),
  inside the server.

Prints one JSON row per system: output tokens/s over the round's wall time (prefill included, as
bench.speculative counts it; the median of the rounds), its ratio to plain, llama.cpp's own decode speed
(``timings.predicted_*``), and from the server's ``/metrics`` (the ``spec_decode_*`` counters, the same names
as cbserve's) the mean acceptance length (tokens a verify step yields: 1 + accepted / verify steps) and the
fraction of drafted tokens accepted; ``same_text_as_plain`` says whether every round's outputs equal plain
decoding's (greedy speculation must not change them).

The weights are not repacked (``--no-repack``; ``--repack`` allows it): on the Intel machine with AMX the
repacking server segfaults while loading. llama.cpp's source is the one vendored in llama-cpp-python's sdist
(0.3.36: libllama 0.5.0-dev, ggml 0.25.3), built for this CPU alone (~9 minutes on 2 cores):

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/llsrc
    tar xzf /tmp/llsrc/llama_cpp_python-*.tar.gz -C /tmp/llsrc
    cmake -S /tmp/llsrc/llama_cpp_python-*/vendor/llama.cpp -B /tmp/llamacpp/build -DCMAKE_BUILD_TYPE=Release \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
    cmake --build /tmp/llamacpp/build -j2 --target llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.gateway_cluster import free_port, wait_healthy
from bench.speculative import GROUNDED
from engine.loader.model_loader import load_tokenizer
from engine.loader.source import default_gguf_path

SERVER = "llama-server"
STARTUP_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 600.0
WARMUP_TOKENS = 8
SYSTEMS = ["plain", "ngram-simple-K", "ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache"]
DEFAULT_SYSTEMS = ["ngram-simple-K", "ngram-simple", "ngram-cache"]


def system_args(name: str, k: int, ngram_size: int) -> list[str]:
    """The ``llama-server`` options that turn on system ``name``'s speculation."""
    if name == "plain":
        return []
    if name == "ngram-simple-K":
        return [
            "--spec-type", "ngram-simple",
            "--spec-ngram-simple-size-n", str(ngram_size),
            "--spec-ngram-simple-size-m", str(k),
        ]  # fmt: skip
    return ["--spec-type", name]


@dataclass(frozen=True)
class Completion:
    """One ``/completion`` answer: its text, its output tokens and llama.cpp's time decoding them."""

    content: str
    tokens: int
    decode_ms: float


def parse_completion(body: dict[str, Any]) -> Completion:
    timings = body["timings"]
    return Completion(body["content"], int(body["tokens_predicted"]), float(timings["predicted_ms"]))


@dataclass(frozen=True)
class SpecCounters:
    """The server's speculative counters (``llamacpp:spec_decode_*_total`` on ``/metrics``)."""

    drafts: float  # verify steps
    draft_tokens: float
    accepted_tokens: float

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return SpecCounters(
            self.drafts - other.drafts,
            self.draft_tokens - other.draft_tokens,
            self.accepted_tokens - other.accepted_tokens,
        )


def parse_spec_counters(metrics_text: str) -> SpecCounters:
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
    }
    names = ["num_drafts", "num_draft_tokens", "num_accepted_tokens"]
    missing = [n for n in names if f"llamacpp:spec_decode_{n}_total" not in values]
    if missing:  # NOTE: llama-servers of other versions may not count them there
        raise ValueError(f"llama-server's /metrics has no llamacpp:spec_decode_{missing[0]}_total")
    return SpecCounters(*[values[f"llamacpp:spec_decode_{n}_total"] for n in names])


@dataclass(frozen=True)
class RoundResult:
    """One system's pass over the prompts."""

    elapsed_s: float
    completions: list[Completion]
    spec: SpecCounters

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.completions)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.elapsed_s

    @property
    def decode_tok_s(self) -> float:
        return self.tokens / (sum(c.decode_ms for c in self.completions) / 1000)


class LlamaServer:
    """A running ``llama-server`` on 127.0.0.1, asked for greedy completions of token ids."""

    def __init__(self, url: str) -> None:
        self.url = url

    def complete(self, prompt: list[int], new_tokens: int) -> Completion:
        body = {
            "prompt": prompt,
            "n_predict": new_tokens,
            "temperature": 0.0,
            # NOTE: every round prefills its prompts again, as bench.speculative's fresh manager does
            "cache_prompt": False,
        }
        response = httpx.post(self.url + "/completion", json=body, timeout=REQUEST_TIMEOUT_S)
        response.raise_for_status()
        return parse_completion(response.json())

    def spec_counters(self) -> SpecCounters:
        response = httpx.get(self.url + "/metrics", timeout=30)
        response.raise_for_status()
        return parse_spec_counters(response.text)


@contextmanager
def llama_server(binary: Path, extra: Sequence[str], log_path: Path) -> Iterator[LlamaServer]:
    """``llama-server`` with ``extra`` options, healthy, stopped on exit; its output in ``log_path``."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(binary), "--host", "127.0.0.1", "--port", str(port), "--metrics", *extra]
    with log_path.open("wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                wait_healthy(url, process, STARTUP_TIMEOUT_S)
            except RuntimeError as e:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{e}\n{' '.join(cmd)}\n... {log_path}:\n{tail}") from None
            yield LlamaServer(url)
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(30)


def grounded_prompts(count: int) -> list[list[int]]:
    """The first ``count`` grounded prompts as the default model's chat template renders them in cbserve."""
    tokenizer = load_tokenizer("default")
    prompts = []
    for text in GROUNDED[:count]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        assert isinstance(ids, list)  # tokenize=True
        prompts.append(ids)
    return prompts


def run(
    binary: Path, base: list[str], extra: list[str], prompts: list[list[int]], new_tokens: int, log: Path
) -> RoundResult:
    """One server for one system: a short warm-up request, then the prompts one after another."""
    with llama_server(binary, [*base, *extra], log) as server:
        server.complete(prompts[0], WARMUP_TOKENS)
        before = server.spec_counters()
        start = time.perf_counter()
        completions = [server.complete(p, new_tokens) for p in prompts]
        elapsed = time.perf_counter() - start
        return RoundResult(elapsed, completions, server.spec_counters() - before)


def summarize(
    system: str, options: list[str], rounds: list[RoundResult], plain: list[RoundResult]
) -> dict[str, Any]:
    """One system's row: medians over the rounds, speculation summed over them."""
    median = statistics.median(r.tok_s for r in rounds)
    row: dict[str, Any] = {
        "workload": "grounded",
        "num_seqs": 1,
        "system": f"llama.cpp {system}",
        "options": " ".join(options),
        "tok_s": round(median, 1),
        "ratio": round(median / statistics.median(r.tok_s for r in plain), 3),
        "decode_tok_s": round(statistics.median(r.decode_tok_s for r in rounds), 1),
        "output_tokens": [r.tokens for r in rounds],
        "runs": [round(r.tok_s, 1) for r in rounds],
    }
    if system != "plain":
        drafts = sum(r.spec.drafts for r in rounds)
        draft_tokens = sum(r.spec.draft_tokens for r in rounds)
        accepted = sum(r.spec.accepted_tokens for r in rounds)
        row["mean_acceptance_length"] = round(1 + accepted / drafts, 2) if drafts else 0.0
        row["accepted_fraction"] = round(accepted / draft_tokens, 3) if draft_tokens else 0.0
        row["draft_tokens"] = int(draft_tokens)
        row["same_text_as_plain"] = all(
            [c.content for c in r.completions] == [c.content for c in p.completions]
            for r, p in zip(rounds, plain, strict=True)
        )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llama-dir", type=Path, required=True, help=f"the folder holding {SERVER}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=len(GROUNDED), help="the first N grounded prompts")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="ngram-simple-K's draft length")
    parser.add_argument(
        "--ngram-size",
        type=int,
        default=3,
        help="ngram-simple-K's lookup n-gram (llama.cpp drafts nothing when it exceeds the draft length)",
    )
    parser.add_argument("--systems", nargs="+", default=DEFAULT_SYSTEMS, choices=SYSTEMS[1:])
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's -t and -tb")
    parser.add_argument(
        "--repack", action="store_true",
        help="let llama.cpp repack the weights for its CPU kernels (off: with AMX it segfaults on loading)",
    )  # fmt: skip
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    binary = args.llama_dir / SERVER
    if not os.access(binary, os.X_OK):
        parser.error(
            f"no executable {SERVER} in {args.llama_dir}: build llama.cpp's server first "
            "(`python -m bench.llamacpp_lookup --help` gives the commands)"
        )
    prompts = grounded_prompts(args.prompts)
    base = ["--model", str(default_gguf_path()), "--ctx-size", "2048", "--parallel", "1"]
    base += ["--threads", str(args.threads), "--threads-batch", str(args.threads)]
    base += [] if args.repack else ["--no-repack"]
    systems = {
        s: system_args(s, args.num_speculative_tokens, args.ngram_size) for s in ["plain", *args.systems]
    }
    results: dict[str, list[RoundResult]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="llamacpp-lookup-") as logs:
        for _ in range(args.rounds):
            for system, extra in systems.items():
                log = Path(logs) / f"{system}.log"
                results[system].append(run(binary, base, extra, prompts, args.new_tokens, log))
    rows = [summarize(s, extra, results[s], results["plain"]) for s, extra in systems.items()]
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
