"""bench/amx_overlap.py: the share a pair of loops hides, and, on a CPU with AMX-BF16, the table end to end --
every instruction kind at every count, with positive times -- and the binding's refusal of a count it has no
loop for."""

from __future__ import annotations

import re

import pytest

from bench.amx_overlap import KINDS, hidden, load, main
from engine.cpu.native_build import KernelUnavailable


def test_hidden_is_one_where_the_pair_takes_the_longer_and_zero_where_it_takes_the_sum() -> None:
    assert hidden(10.0, 15.0, 15.0) == 1.0
    assert hidden(10.0, 15.0, 25.0) == 0.0
    assert hidden(20.0, 15.0, 27.5) == 0.5


def test_prints_every_kind_at_every_count(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        overlap = load()
    except KernelUnavailable as e:
        pytest.skip(f"no AMX here: {e}")
    with pytest.raises(ValueError, match="no loop"):
        overlap.ticks(0, 24, 1, 10)
    assert main(["--counts", "16", "32", "--rounds", "1", "--iters", "2000"]) == 0
    out = capsys.readouterr().out
    assert float(re.search(r"a TDPBF16PS alone: ([\d.]+)", out).group(1)) > 0  # type: ignore[union-attr]
    rows = re.findall(r"^\| (.+?) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| -?\d+% \|$", out, re.MULTILINE)
    assert [(name, int(count)) for name, count, _, _ in rows] == [(k, c) for k in KINDS for c in (16, 32)]
    assert all(float(alone) > 0 and float(both) > 0 for _, _, alone, both in rows)
