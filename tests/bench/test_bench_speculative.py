"""bench/speculative.py runs plain decoding and each speculating system and writes one row per system with
its ratio to plain and its acceptance length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from default_engine import reuse_default_loads

from bench import speculative
from engine.loader.model_loader import LoadedModel

pytestmark = pytest.mark.slow  # the default model


def test_one_round_of_every_system(
    tmp_path: Path, default_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    reuse_default_loads(default_model, monkeypatch)  # the session's load of the bench's model
    out = tmp_path / "spec.json"
    argv = ["--rounds", "1", "--num-seqs", "1", "--new-tokens", "8", "--systems", "ngram", "early_exit"]
    argv += ["--workloads", "grounded"]
    assert speculative.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["workload"], r["system"]) for r in rows] == [
        ("grounded", s) for s in ("plain", "ngram", "early_exit")
    ]
    for row in rows:
        assert row["tok_s"] > 0 and len(row["runs"]) == 1
        assert ("mean_acceptance_length" in row) == (row["system"] != "plain")
    assert all(r["ratio"] == 1.0 for r in rows if r["system"] == "plain")
