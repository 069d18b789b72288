"""Saved serving runs (``--save-result`` JSON) as one markdown table: output tokens/s, TTFT and ITL per
system and concurrency, with each system's throughput as a ratio of the first system's.

    python -m bench.summarize results/*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def load(paths: list[str]) -> list[dict[str, Any]]:
    runs = []
    for p in paths:
        doc = json.loads(Path(p).read_text())
        label = str(doc.get("label") or Path(p).stem)
        doc["system"] = label.split(" c=")[0]
        runs.append(doc)
    return runs


def table(runs: list[dict[str, Any]]) -> str:
    systems = list(dict.fromkeys(r["system"] for r in runs))
    by_key = {(r["system"], r.get("max_concurrency")): r for r in runs}
    concurrencies = sorted({r.get("max_concurrency") or 0 for r in runs})
    base = systems[0]
    lines = [
        "| concurrency | system | completed/failed | output tok/s | vs " + base + " | median TTFT ms | p99 TTFT ms "
        "| median ITL ms | p99 ITL ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in concurrencies:
        ref = by_key.get((base, c))
        for s in systems:
            r = by_key.get((s, c))
            if r is None:
                continue
            ratio = r["output_throughput"] / ref["output_throughput"] if ref and ref["output_throughput"] else 0.0
            lines.append(
                f"| {c} | {s} | {r['completed']}/{r['failed']} | {r['output_throughput']:.1f} | {ratio:.2f}x "
                f"| {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['median_itl_ms']:.1f} "
                f"| {r['p99_itl_ms']:.1f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__)
        return 2
    print(table(load(paths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
