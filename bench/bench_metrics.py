"""What one benchmark run measured: per-request records in, vLLM's benchmark_serving metrics out.

Definitions (vLLM's `calculate_metrics`; latencies in seconds in the records, in ms in the metrics):
- TTFT: request sent -> first SSE chunk that carries content.
- ITL: the gaps between consecutive content chunks, pooled over all successful requests.
- TPOT: per request (e2el - ttft) / (output_tokens - 1), for requests with more than one output token.
- E2EL: request sent -> end of the response stream.
- throughput: completed requests, output tokens and input + output tokens, each over the run's duration;
  input tokens count successful requests only.
- peak output tokens/s: output tokens bucketed by the whole second (since the first successful request
  started) in which their chunk arrived, the largest bucket. A chunk weighs output_tokens / chunks, so a
  server that sends several tokens per chunk is counted right (one token per chunk gives vLLM's count).
- peak concurrent requests: the largest number of successful requests active in one such second
  (vLLM's definition); `peak_inflight_requests` is the exact largest number in flight at one instant.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
LATENCY_TITLES: dict[str, tuple[str, str]] = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


@dataclass
class RequestRecord:
    """The outcome of one benchmark request; filled by the client while the response streams.

    Times are seconds: `start_time` since the run started, the others since the request was sent.
    `output_tokens` is the server's usage count when it sent one, else the generated text's token count.
    """

    prompt_len: int
    expected_output_len: int
    start_time: float = 0.0
    success: bool = False
    error: str = ""
    generated_text: str = ""
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0

    @property
    def num_chunks(self) -> int:
        """Content chunks of a successful request: the first one, then one per inter-token gap."""
        # NOTE: success implies at least one content chunk (the client fails a request without one).
        return len(self.itl) + 1 if self.success else 0

    def chunk_times(self) -> list[float]:
        """Arrival time of each content chunk of a successful request, in seconds since the run started."""
        if self.num_chunks == 0:
            return []
        times = [self.start_time + self.ttft]
        for gap in self.itl:
            times.append(times[-1] + gap)
        return times


@dataclass(frozen=True)
class LatencyStats:
    """Mean, median, standard deviation and chosen percentiles of one latency, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    @staticmethod
    def of(values_s: Sequence[float], percentiles: Sequence[float]) -> LatencyStats:
        # NOTE: vLLM reports 0 for a metric with no samples (e.g. TPOT when every output is 1 token).
        data = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
        return LatencyStats(
            mean=float(np.mean(data)),
            median=float(np.median(data)),
            std=float(np.std(data)),
            percentiles={float(p): float(np.percentile(data, p)) for p in percentiles},
        )


@dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration: float  # seconds
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output tokens) / s
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    peak_inflight_requests: int
    latencies: dict[str, LatencyStats]  # keyed by LATENCY_METRICS
    output_lens: list[int]  # per request, 0 for a failed one


def tpot_of(record: RequestRecord) -> float | None:
    """(e2el - ttft) / (output_tokens - 1): the mean time per token after the first; None for one token."""
    if not record.success or record.output_tokens <= 1:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


def output_tokens_per_second(records: Sequence[RequestRecord]) -> list[float]:
    """Output tokens per whole-second bucket since the first successful request started."""
    ok = [r for r in records if r.success]
    if not ok:
        return []
    origin = min(r.start_time for r in ok)
    end = max(r.start_time + r.latency for r in ok)
    buckets = [0.0] * (int(math.floor(end - origin)) + 1)
    for r in ok:
        times = r.chunk_times()
        if not times:
            continue
        weight = r.output_tokens / len(times)
        for t in times:
            # NOTE: clamp: a chunk time can exceed start + latency by float rounding only.
            buckets[min(int(t - origin), len(buckets) - 1)] += weight
    return buckets


def concurrent_requests_per_second(records: Sequence[RequestRecord]) -> list[int]:
    """Successful requests active at some point of each whole-second bucket (vLLM's concurrency)."""
    ok = [r for r in records if r.success]
    if not ok:
        return []
    origin = min(r.start_time for r in ok)
    end = max(r.start_time + r.latency for r in ok)
    buckets = [0] * (int(math.floor(end - origin)) + 1)
    for r in ok:
        first = int(r.start_time - origin)
        last = min(int(r.start_time + r.latency - origin), len(buckets) - 1)
        for second in range(first, last + 1):
            buckets[second] += 1
    return buckets


def peak_inflight(records: Sequence[RequestRecord]) -> int:
    """The largest number of successful requests in flight at one instant (a sweep over start/end)."""
    # An end sorts before a start at the same instant: a request that ends as another begins never
    # overlaps it.
    events = sorted(
        [(r.start_time, 1) for r in records if r.success]
        + [(r.start_time + r.latency, -1) for r in records if r.success]
    )
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def calculate_metrics(
    records: Sequence[RequestRecord], duration: float, percentiles: Sequence[float] = (50.0, 90.0, 99.0)
) -> BenchmarkMetrics:
    """The run's metrics from its request records and its duration in seconds."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    for p in percentiles:
        if not 0.0 <= p <= 100.0:
            raise ValueError(f"percentiles must be in [0, 100], got {p}")
    ok = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in ok)
    output_lens = [r.output_tokens if r.success else 0 for r in records]
    total_output = sum(output_lens)
    samples: dict[str, list[float]] = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := tpot_of(r)) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    tokens_per_s = output_tokens_per_second(records)
    concurrency = concurrent_requests_per_second(records)
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        total_input=total_input,
        total_output=total_output,
        duration=duration,
        request_throughput=len(ok) / duration,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        max_output_tokens_per_s=max(tokens_per_s, default=0.0),
        max_concurrent_requests=max(concurrency, default=0),
        peak_inflight_requests=peak_inflight(records),
        latencies={name: LatencyStats.of(samples[name], percentiles) for name in LATENCY_METRICS},
        output_lens=output_lens,
    )


def percentile_key(p: float) -> str:
    """vLLM's spelling of a percentile in a key: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if float(p).is_integer() else str(p)


def metrics_to_dict(metrics: BenchmarkMetrics, records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The metrics and per-request lists under vLLM's result-JSON key names (lists in seconds)."""
    result: dict[str, Any] = {
        "duration": metrics.duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "peak_inflight_requests": metrics.peak_inflight_requests,
    }
    for name, stats in metrics.latencies.items():
        result[f"mean_{name}_ms"] = stats.mean
        result[f"median_{name}_ms"] = stats.median
        result[f"std_{name}_ms"] = stats.std
        for p, value in stats.percentiles.items():
            result[f"p{percentile_key(p)}_{name}_ms"] = value
    result.update(
        {
            "input_lens": [r.prompt_len for r in records],
            "output_lens": metrics.output_lens,
            "ttfts": [r.ttft for r in records],
            "itls": [list(r.itl) for r in records],
            "latencies": [r.latency for r in records],
            "start_times": [r.start_time for r in records],
            "successes": [r.success for r in records],
            "generated_texts": [r.generated_text for r in records],
            "errors": [r.error for r in records],
        }
    )
    return result


def format_metrics(metrics: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    """The printed result block, laid out as vLLM's benchmark_serving prints it."""
    lines = [f"{' ' + title + ' ':=^50}"]

    def row(label: str, value: float | int) -> None:
        text = f"{value:<10}" if isinstance(value, int) else f"{value:<10.2f}"
        lines.append(f"{label:<40} {text}".rstrip())

    row("Successful requests:", metrics.completed)
    row("Failed requests:", metrics.failed)
    row("Benchmark duration (s):", metrics.duration)
    row("Total input tokens:", metrics.total_input)
    row("Total generated tokens:", metrics.total_output)
    row("Request throughput (req/s):", metrics.request_throughput)
    row("Output token throughput (tok/s):", metrics.output_throughput)
    row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s)
    row("Peak concurrent requests:", metrics.max_concurrent_requests)
    row("Peak in-flight requests:", metrics.peak_inflight_requests)
    row("Total token throughput (tok/s):", metrics.total_token_throughput)
    for name in LATENCY_METRICS:
        header, short = LATENCY_TITLES[name]
        stats = metrics.latencies[name]
        lines.append(f"{header:-^50}")
        row(f"Mean {short} (ms):", stats.mean)
        row(f"Median {short} (ms):", stats.median)
        for p, value in stats.percentiles.items():
            row(f"P{percentile_key(p)} {short} (ms):", value)
    lines.append("=" * 50)
    return "\n".join(lines)
