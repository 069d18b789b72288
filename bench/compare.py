"""Two saved runs (`--save-result` JSON) side by side, with the ratio B/A of every number.

For throughputs a ratio above 1 means B is faster; for latencies a ratio below 1 means B is faster.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from bench.bench_metrics import LATENCY_METRICS

SETUP_KEYS = ("model_id", "backend", "base_url", "dataset_name", "num_prompts", "request_rate",
              "burstiness", "max_concurrency")
SUMMARY_KEYS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
)
REQUIRED_KEYS = ("completed", "duration", "output_throughput")


def load_result(path: str | Path) -> dict[str, Any]:
    """A result JSON written by `--save-result` (or by vLLM's benchmark_serving)."""
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read a benchmark result from {path}: {exc}") from exc
    if not isinstance(result, dict) or any(key not in result for key in REQUIRED_KEYS):
        raise ValueError(f"{path} is not a benchmark result (needs the keys {', '.join(REQUIRED_KEYS)})")
    return result


def _latency_keys(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """mean, median and each percentile key both runs have, metric by metric in the printed order."""
    keys = []
    for metric in LATENCY_METRICS:
        percentile_keys = sorted(
            (k for k in a if re.fullmatch(rf"p[0-9.]+_{metric}_ms", k) and k in b),
            key=lambda k: float(k[1:].split("_", 1)[0]),
        )
        for key in [f"mean_{metric}_ms", f"median_{metric}_ms", *percentile_keys]:
            if key in a and key in b:
                keys.append(key)
    return keys


def ratio(a: Any, b: Any) -> str:
    """b / a as text; "-" when it has no meaning (a is zero or either is not a number)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return "-"
    if not isinstance(a, int | float) or not isinstance(b, int | float) or a == 0:
        return "-"
    return f"{b / a:.3f}"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "-" if value is None else str(value)


def format_comparison(a: dict[str, Any], b: dict[str, Any], label_a: str = "A", label_b: str = "B") -> str:
    """A table: one row per setting and metric, columns A, B and B/A."""
    width = max(22, len(label_a) + 2, len(label_b) + 2)
    lines = [f"{'':<32}{label_a:>{width}}{label_b:>{width}}{'B/A':>10}"]

    def row(key: str, with_ratio: bool) -> None:
        va, vb = a.get(key), b.get(key)
        shown = ratio(va, vb) if with_ratio else ""
        lines.append(f"{key:<32}{_cell(va):>{width}}{_cell(vb):>{width}}{shown:>10}")

    for key in SETUP_KEYS:
        if key in a or key in b:
            row(key, with_ratio=False)
    lines.append("-" * len(lines[0]))
    for key in SUMMARY_KEYS:
        if key in a and key in b:
            row(key, with_ratio=True)
    for key in _latency_keys(a, b):
        row(key, with_ratio=True)
    return "\n".join(lines)
