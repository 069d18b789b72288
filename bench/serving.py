"""Load-test any OpenAI-compatible server (cbserve, vLLM, llama.cpp's server, `transformers serve`).

The client streams every request (SSE `data:` lines up to `[DONE]`) from `/v1/completions` or
`/v1/chat/completions`, timestamps each chunk that carries content, and reports vLLM's benchmark_serving
metrics (bench/bench_metrics.py). Arrivals are all at once (`--request-rate inf`) or a Poisson process
(gamma intervals with `--burstiness`), optionally capped by `--max-concurrency`. A run is bounded in
requests (`--num-prompts`) and in time (`--timeout`: whatever has not finished by then is cancelled and
counted as failed).

    python -m bench --base-url http://127.0.0.1:8000 --dataset random --num-prompts 32 \
        --random-input-len 256 --random-output-len 64 --request-rate 4 --save-result run.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from bench.bench_metrics import RequestRecord, calculate_metrics, format_metrics, metrics_to_dict
from bench.datasets import (
    SampleRequest,
    TokenizerLike,
    sample_prefix_repetition_requests,
    sample_random_requests,
    sample_sharegpt_requests,
)

DATASETS = ("random", "sharegpt", "prefix-repetition")
# NOTE: connect/write bounds catch a dead server fast; reads are unbounded per chunk because the run's
# own deadline (--timeout) bounds every request, and a long prefill legitimately waits a while.
HTTP_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=30.0, pool=None)
MAX_ERROR_CHARS = 500

TokenizerLoader = Callable[[str], TokenizerLike]


class BenchmarkError(RuntimeError):
    """The run could not start (server unreachable, warm-up failed, no model listed)."""


def load_default_tokenizer(name: str) -> TokenizerLike:
    """The served model's tokenizer, loaded as the server loads it (engine.loader.model_loader)."""
    # NOTE: imported here so that --compare and the metrics never pull in the engine (and torch).
    from engine.loader.model_loader import load_tokenizer

    tokenizer: TokenizerLike = load_tokenizer(name)
    return tokenizer


@dataclass(frozen=True)
class BenchConfig:
    """How to load the server: where, what to send, how fast, for how long. Validated on construction."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    num_prompts: int = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 1
    timeout: float = 600.0
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if not self.endpoint.startswith("/") or not self.endpoint.endswith("completions"):
            raise ValueError(
                f"endpoint must be a completions path such as /v1/completions or /v1/chat/completions, "
                f"got {self.endpoint!r}"
            )
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {self.timeout}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        for p in self.percentiles:
            if not 0.0 <= p <= 100.0:
                raise ValueError(f"percentiles must be in [0, 100], got {p}")

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def backend(self) -> str:
        """vLLM's name for the request function: openai (completions) or openai-chat."""
        return "openai-chat" if self.is_chat else "openai"

    @property
    def api_url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RunOutcome:
    records: list[RequestRecord]
    duration: float  # seconds from the first arrival to the last completion (or the deadline)
    timed_out: bool
    model: str


def build_payload(config: BenchConfig, model: str, request: SampleRequest) -> dict[str, Any]:
    """The JSON body of one streaming request; `stream_options.include_usage` asks for exact token counts
    and `ignore_eos` is vLLM's extension (servers that do not know it ignore it or reject the request)."""
    payload: dict[str, Any] = {"model": model}
    if config.is_chat:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    payload.update(
        {
            "max_tokens": request.expected_output_len,
            "temperature": config.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    if config.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(config.extra_body)
    return payload


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line, or None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


def chunk_content(choice: dict[str, Any], is_chat: bool) -> str:
    """The text a streamed choice carries: `text` for completions, `delta.content` (or a reasoning model's
    `delta.reasoning_content`) for chat."""
    if not is_chat:
        text = choice.get("text")
        return text if isinstance(text, str) else ""
    delta = choice.get("delta") or {}
    parts = [delta.get(key) for key in ("reasoning_content", "reasoning", "content")]
    return "".join(p for p in parts if isinstance(p, str))


def _error_text(event: dict[str, Any]) -> str | None:
    """The message of an error event sent inside the stream, or None when the event is not an error."""
    error = event.get("error")
    if error is None and event.get("object") == "error":
        error = event
    if error is None:
        return None
    if isinstance(error, dict):
        return str(error.get("message") or error)[:MAX_ERROR_CHARS]
    return str(error)[:MAX_ERROR_CHARS]


async def send_request(
    client: httpx.AsyncClient,
    config: BenchConfig,
    payload: dict[str, Any],
    record: RequestRecord,
    run_start: float,
    count_tokens: Callable[[str], int],
) -> None:
    """Stream one request and fill `record`; every failure is recorded in it, never raised (a
    cancellation still propagates, and the caller marks the record)."""
    sent = time.perf_counter()
    record.start_time = sent - run_start
    last_content = sent
    parts: list[str] = []
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", config.api_url, json=payload, headers=config.headers()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:MAX_ERROR_CHARS]}"
                return
            async for line in response.aiter_lines():
                data = sse_data(line)
                if not data:
                    continue
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if not isinstance(event, dict):
                    continue
                if (error := _error_text(event)) is not None:
                    record.error = f"error event in stream: {error}"
                    return
                choices = event.get("choices")
                if choices:
                    content = chunk_content(choices[0], config.is_chat)
                    # NOTE: only chunks with text count as tokens: a chat stream opens with a role-only
                    # delta and may close with an empty one carrying finish_reason.
                    if content:
                        if not parts:
                            record.ttft = now - sent
                        else:
                            record.itl.append(now - last_content)
                        last_content = now
                        parts.append(content)
                usage = event.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
        end = time.perf_counter()
    except Exception as exc:  # the server's fault or the network's: a failed request, not a crashed run
        record.error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        return
    record.generated_text = "".join(parts)
    if not parts:
        record.error = "the stream carried no content chunk (no TTFT to measure)"
        return
    record.latency = end - sent
    record.output_tokens = usage_tokens if usage_tokens is not None else count_tokens(record.generated_text)
    record.success = True


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """When each request arrives, in seconds after the first: all at 0 for an infinite rate, else the
    partial sums of gamma(burstiness, 1 / (rate * burstiness)) intervals (burstiness 1: Poisson)."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    intervals = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0] + [float(t) for t in np.cumsum(intervals)]


async def fetch_model_id(client: httpx.AsyncClient, config: BenchConfig) -> str:
    """The first model the server lists at GET /v1/models."""
    url = config.base_url.rstrip("/") + "/v1/models"
    try:
        response = await client.get(url, headers=config.headers(), timeout=30.0)
        response.raise_for_status()
        models = response.json().get("data") or []
        return str(models[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise BenchmarkError(f"cannot read a model id from {url} (pass --model): {exc}") from exc


# NOTE: the warm-up never sends a measured prompt: a server with a prefix cache would then skip that
# prompt's prefill in the measured run (and a short prompt fills no whole cache block to share).
WARMUP_PROMPT = "Warm-up: say hello."
WARMUP_OUTPUT_LEN = 8


async def _warm_up(
    client: httpx.AsyncClient,
    config: BenchConfig,
    model: str,
    count_tokens: Callable[[str], int],
) -> None:
    """Send `num_warmups` short requests one after another; they check the server and are not measured."""
    request = SampleRequest(WARMUP_PROMPT, count_tokens(WARMUP_PROMPT), WARMUP_OUTPUT_LEN)
    for i in range(config.num_warmups):
        record = RequestRecord(request.prompt_len, request.expected_output_len)
        await send_request(
            client, config, build_payload(config, model, request), record, time.perf_counter(), count_tokens
        )
        if not record.success:
            raise BenchmarkError(f"warm-up request {i + 1} failed: {record.error}")


async def run_benchmark(
    config: BenchConfig, requests: Sequence[SampleRequest], count_tokens: Callable[[str], int]
) -> RunOutcome:
    """Warm up, then send `requests` on their arrival schedule; stop at the deadline (`config.timeout`
    seconds after this call), cancelling what is unfinished and counting it as failed."""
    deadline = time.monotonic() + config.timeout
    limit = config.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    # NOTE: trust_env=False: a benchmark talks to the server directly, never through a proxy from the env.
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, limits=limits, trust_env=False) as client:

        async def prepare() -> str:
            model = config.model or await fetch_model_id(client, config)
            if config.num_warmups:
                await _warm_up(client, config, model, count_tokens)
            return model

        try:
            model = await asyncio.wait_for(prepare(), timeout=max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError as exc:
            raise BenchmarkError(f"model lookup and warm-up did not finish within {config.timeout} s") from exc

        records = [RequestRecord(r.prompt_len, r.expected_output_len) for r in requests]
        offsets = arrival_offsets(len(requests), config.request_rate, config.burstiness, config.seed)
        semaphore = asyncio.Semaphore(limit)
        sent = [False] * len(requests)
        progress = tqdm(total=len(requests), disable=config.disable_tqdm, file=sys.stderr, unit="req")
        run_start = time.perf_counter()

        async def one(i: int) -> None:
            delay = offsets[i] - (time.perf_counter() - run_start)
            if delay > 0:
                await asyncio.sleep(delay)
            async with semaphore:
                sent[i] = True
                payload = build_payload(config, model, requests[i])
                await send_request(client, config, payload, records[i], run_start, count_tokens)
            progress.update(1)

        tasks = [asyncio.create_task(one(i)) for i in range(len(requests))]
        _, pending = await asyncio.wait(tasks, timeout=max(deadline - time.monotonic(), 0.0))
        duration = time.perf_counter() - run_start
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        progress.close()
        for task, record, was_sent in zip(tasks, records, sent, strict=True):
            if task in pending:
                record.success = False
                record.error = (
                    f"cancelled: the run's {config.timeout} s timeout ended it"
                    if was_sent
                    else f"never sent: the run's {config.timeout} s timeout came first"
                )
    return RunOutcome(records=records, duration=duration, timed_out=bool(pending), model=model)


def build_requests(args: argparse.Namespace, tokenizer: TokenizerLike) -> list[SampleRequest]:
    """The workload named by --dataset, with its options."""
    if args.dataset == "random":
        return sample_random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE (a local ShareGPT JSON file)")
        return sample_sharegpt_requests(
            tokenizer, args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed
        )
    return sample_prefix_repetition_requests(
        tokenizer,
        args.num_prompts,
        args.prefix_len,
        args.suffix_len,
        args.num_prefixes,
        args.prefix_output_len,
        args.seed,
    )


def _parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"percentiles must be comma-separated numbers: {text!r}") from exc


def _parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cbserve bench", description="Benchmark an OpenAI-compatible server with streaming requests."
    )
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000")
    target.add_argument(
        "--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions"
    )
    target.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")
    target.add_argument("--model", default=None, help="model id to send (default: first of GET /v1/models)")
    target.add_argument(
        "--tokenizer", default="default", help="tokenizer for prompt and output lengths (the served model's)"
    )
    target.add_argument("--label", default=None, help="name of this run in results, plots and comparisons")

    data = parser.add_argument_group("workload")
    data.add_argument("--dataset", choices=DATASETS, default="random")
    data.add_argument("--dataset-path", default=None, help="ShareGPT JSON file for --dataset sharegpt")
    data.add_argument("--num-prompts", type=int, default=100)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument(
        "--sharegpt-output-len", type=int, default=None, help="replace each reply's length with this"
    )
    data.add_argument("--prefix-len", type=int, default=256)
    data.add_argument("--suffix-len", type=int, default=256)
    data.add_argument("--num-prefixes", type=int, default=10)
    data.add_argument("--prefix-output-len", type=int, default=128)

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 is Poisson")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--num-warmups", type=int, default=1)
    load.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    load.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (vLLM's extension)")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument(
        "--extra-body", type=_parse_json_object, default={}, help="JSON object merged into every request"
    )

    out = parser.add_argument_group("results")
    out.add_argument("--percentiles", type=_parse_percentiles, default=(50.0, 90.0, 99.0))
    out.add_argument("--save-result", default=None, metavar="FILE.json")
    out.add_argument("--plot", default=None, metavar="FILE.png", help="latency CDFs and throughput over time")
    out.add_argument(
        "--compare",
        nargs=2,
        default=None,
        metavar=("A.json", "B.json"),
        help="print two saved runs side by side (ratios B/A) instead of running",
    )
    out.add_argument("--disable-tqdm", action="store_true")
    return parser


def _config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY"),
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        timeout=args.timeout,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=args.extra_body,
        seed=args.seed,
        percentiles=args.percentiles,
        disable_tqdm=args.disable_tqdm,
    )


def _compare(args: argparse.Namespace) -> int:
    from bench.compare import format_comparison, load_result

    first, second = (load_result(path) for path in args.compare)
    labels = [r.get("label") or path for r, path in zip((first, second), args.compare, strict=True)]
    print(format_comparison(first, second, labels[0], labels[1]))
    if args.plot:
        from bench.plot import plot_results

        plot_results([first, second], labels, args.plot)
    return 0


def main(argv: list[str] | None = None, *, tokenizer_loader: TokenizerLoader | None = None) -> int:
    """`cbserve bench`: run one benchmark (or --compare two saved ones). Returns 0 when some request
    succeeded, 1 when the run could not start or every request failed, 2 for invalid options."""
    args = build_parser().parse_args(argv)
    if args.compare:
        try:
            return _compare(args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:
        config = _config_from_args(args)
        tokenizer = (tokenizer_loader or load_default_tokenizer)(args.tokenizer)
        requests = build_requests(args, tokenizer)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    try:
        outcome = asyncio.run(run_benchmark(config, requests, count_tokens))
    except BenchmarkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    metrics = calculate_metrics(outcome.records, outcome.duration, config.percentiles)
    print(format_metrics(metrics))
    if outcome.timed_out:
        print(f"warning: the {config.timeout} s timeout ended the run early", file=sys.stderr)
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": args.label or outcome.model,
        "backend": config.backend,
        "endpoint": config.endpoint,
        "base_url": config.base_url,
        "model_id": outcome.model,
        "tokenizer_id": args.tokenizer,
        "dataset_name": args.dataset,
        "num_prompts": config.num_prompts,
        "request_rate": config.request_rate if math.isfinite(config.request_rate) else "inf",
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "ignore_eos": config.ignore_eos,
        "seed": config.seed,
        "timeout": config.timeout,
        "timed_out": outcome.timed_out,
        **metrics_to_dict(metrics, outcome.records),
    }
    if args.save_result:
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        from bench.plot import plot_results

        plot_results([result], [result["label"]], args.plot)
    return 0 if metrics.completed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
