"""bench/prefill_attention_ab.py runs both sides on the default model, prints one line per side and leaves
the engine's prefill path as it found it."""

from __future__ import annotations

import pytest
from default_engine import reuse_default_loads

from bench import prefill_attention_ab
from engine.executor.attention import paged
from engine.executor.models import llama
from engine.loader.model_loader import LoadedModel

pytestmark = pytest.mark.slow  # both sides timed on the default model


def test_prints_both_sides_and_restores_the_kernel(
    capsys: pytest.CaptureFixture[str], default_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    reuse_default_loads(default_model, monkeypatch)  # the session's load of the bench's model
    part, attention = paged._prefill_part, llama.paged_attention
    rc = prefill_attention_ab.main(["--runs", "2", "--prompts", "3", "--prompt-len", "20"])
    out = capsys.readouterr().out
    if rc == 1:
        pytest.skip(out.strip())
    assert rc == 0
    lines = out.strip().splitlines()
    assert [line.split(" prefill of")[0].strip() for line in lines] == ["sdpa per sequence", "prefill kernel"]
    assert all("3 x 20: best" in line and "attention: best" in line for line in lines)
    # both sides really ran their attention (a side whose prefill fails raises instead of printing)
    assert all(float(line.split("attention: best ")[1].split(" ms")[0]) > 0 for line in lines)
    assert paged._prefill_part is part and llama.paged_attention is attention
