"""bench/decode_stack_ab.py runs both sides on the default model and prints one line per side."""

from __future__ import annotations

import pytest
from default_engine import reuse_default_loads

from bench import decode_stack_ab
from engine.loader.model_loader import LoadedModel

pytestmark = pytest.mark.slow  # both sides timed on the default model


def test_prints_both_sides(
    capsys: pytest.CaptureFixture[str], default_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    reuse_default_loads(default_model, monkeypatch)  # the session's load of the bench's model
    rc = decode_stack_ab.main(["--runs", "2", "--prompts", "3", "--prompt-len", "20", "--new-tokens", "3"])
    out = capsys.readouterr().out
    if rc == 1:
        pytest.skip(out.strip())
    assert rc == 0
    lines = out.strip().splitlines()
    assert [line.split(" whole run")[0].strip() for line in lines] == ["layer by layer", "decode stack"]
    assert all("3-sequence decode forward: best" in line for line in lines)
