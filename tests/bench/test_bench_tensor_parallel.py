"""bench/tensor_parallel.py runs its three sides (one process with and without the decode stack, two ranks)
and prints one line each, then the bound on the collectives' cost."""

from __future__ import annotations

import pytest

from bench import tensor_parallel

pytestmark = pytest.mark.slow  # spawns a rank; the default model's tokenizer


def test_prints_every_side(capsys: pytest.CaptureFixture[str]) -> None:
    rc = tensor_parallel.main(["--runs", "1", "--prompts", "2", "--prompt-len", "8", "--new-tokens", "2"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0].strip() for line in lines] == [
        "one process",
        "one process, no decode stack",
        "2 ranks",
        "collectives + broadcast, at most",
    ]
