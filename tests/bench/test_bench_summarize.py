"""bench/summarize.py: saved runs become one table with throughput ratios against the first system."""

from __future__ import annotations

import json
from pathlib import Path

from bench.summarize import load, table


def run(path: Path, label: str, c: int, tput: float) -> str:
    doc = {
        "label": label,
        "max_concurrency": c,
        "completed": 8,
        "failed": 0,
        "output_throughput": tput,
        "median_ttft_ms": 100.0,
        "p99_ttft_ms": 200.0,
        "median_itl_ms": 10.0,
        "p99_itl_ms": 20.0,
    }
    path.write_text(json.dumps(doc))
    return str(path)


def test_table_has_one_row_per_system_and_concurrency_with_ratios(tmp_path: Path) -> None:
    paths = [
        run(tmp_path / "a1.json", "cbserve c=1", 1, 50.0),
        run(tmp_path / "b1.json", "peer c=1", 1, 25.0),
        run(tmp_path / "a16.json", "cbserve c=16", 16, 300.0),
        run(tmp_path / "b16.json", "peer c=16", 16, 100.0),
    ]
    lines = table(load(paths)).splitlines()
    assert len(lines) == 2 + 4
    assert "| 1 | peer | 8/0 | 25.0 | 0.50x |" in lines[3]
    assert "| 16 | peer | 8/0 | 100.0 | 0.33x |" in lines[5]
    assert lines[4].startswith("| 16 | cbserve | 8/0 | 300.0 | 1.00x |")
