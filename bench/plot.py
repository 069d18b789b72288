"""Plots of one or more saved runs: latency CDFs (TTFT, ITL, E2EL) and output throughput over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_metrics import RequestRecord, output_tokens_per_second


def records_from_result(result: dict[str, Any]) -> list[RequestRecord]:
    """Rebuild the per-request records of a result JSON (the successful ones carry all timings)."""
    n = len(result.get("ttfts", []))
    successes = result.get("successes") or [not e for e in result.get("errors", [""] * n)]
    start_times = result.get("start_times") or [0.0] * n
    records = []
    for i in range(n):
        records.append(
            RequestRecord(
                prompt_len=int(result["input_lens"][i]),
                expected_output_len=0,
                start_time=float(start_times[i]),
                success=bool(successes[i]),
                output_tokens=int(result["output_lens"][i]),
                ttft=float(result["ttfts"][i]),
                itl=[float(x) for x in result["itls"][i]],
                latency=float(result["latencies"][i]) if "latencies" in result else 0.0,
            )
        )
    return records


def _cdf(ax: Any, values_ms: Sequence[float], label: str) -> None:
    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms, dtype=np.float64))  # [num_samples]
    ys = np.arange(1, xs.size + 1) / xs.size  # [num_samples]
    # The curve rises from 0 at the smallest sample, so that a few samples still read as a CDF.
    ax.step(np.concatenate([xs[:1], xs]), np.concatenate([[0.0], ys]), where="post", label=label)


def _legend(ax: Any) -> None:
    # A run with no successful request draws nothing; a legend without entries only warns.
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


def plot_results(results: Sequence[dict[str, Any]], labels: Sequence[str], path: str | Path) -> None:
    """Write a 2x2 figure to `path`: CDFs of TTFT, ITL and E2EL in ms, and output tokens per second of
    each run over its duration (whole-second buckets). Several runs are overlaid, one colour each."""
    if len(results) != len(labels):
        raise ValueError(f"{len(results)} results but {len(labels)} labels")
    # NOTE: a bare Figure renders with Agg and touches no pyplot global state (no display needed).
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8))
    axes = fig.subplots(2, 2)
    panels = [(axes[0][0], "TTFT"), (axes[0][1], "ITL"), (axes[1][0], "E2EL")]
    for result, label in zip(results, labels, strict=True):
        ok = [r for r in records_from_result(result) if r.success]
        _cdf(axes[0][0], [r.ttft * 1000 for r in ok], label)
        _cdf(axes[0][1], [gap * 1000 for r in ok for gap in r.itl], label)
        _cdf(axes[1][0], [r.latency * 1000 for r in ok], label)
        buckets = output_tokens_per_second(ok)
        axes[1][1].plot(np.arange(len(buckets)), buckets, marker="o", markersize=3, label=label)
    for ax, name in panels:
        ax.set_title(f"{name} CDF")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(True, alpha=0.3)
        _legend(ax)
    throughput = axes[1][1]
    throughput.set_title("Output throughput over time")
    throughput.set_xlabel("second of the run")
    throughput.set_ylabel("output tokens/s")
    throughput.set_ylim(bottom=0)
    throughput.grid(True, alpha=0.3)
    _legend(throughput)
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
