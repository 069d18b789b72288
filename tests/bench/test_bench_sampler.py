"""bench/sampler.py: both sides of the sampler's step end to end, the same tokens, a line per row count."""

from __future__ import annotations

import re

import pytest

from bench.sampler import main


@pytest.mark.parametrize("logprobs", [False, True])
def test_prints_both_sides_with_the_same_tokens(capsys: pytest.CaptureFixture[str], logprobs: bool) -> None:
    assert (
        main(["--rows", "1", "3", "--vocab", "3000", "--rounds", "4", *(["--logprobs"] if logprobs else [])])
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        if "no C compiler" in line:
            continue
        assert re.search(r"C pass median +[\d.]+ us best +[\d.]+ us \| PyTorch median +[\d.]+ us", line), line
        assert line.endswith("same tokens")
