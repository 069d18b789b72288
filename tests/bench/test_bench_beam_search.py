"""bench/beam_search.py end to end on a tiny random model: both systems run and report equal token counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from model_harness import BYTE_EOS, save_byte_tokenizer

from bench.beam_search import main


@pytest.mark.slow  # two systems timed
def test_both_systems_output_the_same_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, eos_token_id=BYTE_EOS, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    folder = tmp_path / "tiny"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    save_byte_tokenizer(folder)
    saved = tmp_path / "run.json"
    argv = ["--model", str(folder), "--num-prompts", "3", "--num-beams", "2", "--min-prompt", "4"]
    argv += ["--max-prompt", "8", "--min-new", "4", "--max-new", "6", "--static-batch-size", "2"]
    assert main([*argv, "--save-result", str(saved)]) == 0
    results = json.loads(saved.read_text())["results"]
    assert len(results) == 2
    assert results[0]["output_tokens"] == results[1]["output_tokens"] > 0
    assert "tok/s" in capsys.readouterr().out
