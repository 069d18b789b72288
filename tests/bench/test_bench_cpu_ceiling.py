"""bench/cpu_ceiling.py: the work count against a token-by-token count written out here, the FMA loop, and
the CLI on a saved run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from bench.cpu_ceiling import fma_peak_gflops, main, request_work, run_work
from engine.cpu.native_build import KernelUnavailable
from engine.loader.dummy import get_preset
from engine.model_config import ModelConfig


def token_by_token(cfg: ModelConfig, prompt_len: int, output_len: int) -> tuple[int, int]:
    """(linear, attention) flops, walking every position of the sequence through every layer."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    linear = attention = 0
    fed = prompt_len + output_len - 1
    for pos in range(fed):
        wants_logits = pos >= prompt_len - 1
        for layer in range(cfg.num_hidden_layers):
            linear += 2 * h * 2 * kv_out  # k and v: every fed token needs them in every layer
            if layer == cfg.num_hidden_layers - 1 and not wants_logits:
                continue
            linear += 2 * h * q_out  # q
            attention += 2 * 2 * cfg.num_attention_heads * hd * (pos + 1)  # q.k and p.v over pos + 1 keys
            linear += 2 * q_out * h  # o
            linear += 2 * h * cfg.intermediate_size * 2 + 2 * cfg.intermediate_size * h  # gate, up, down
        if wants_logits:
            linear += 2 * h * cfg.vocab_size
    return linear, attention


@pytest.mark.parametrize("prompt_len,output_len", [(1, 1), (3, 2), (5, 1), (2, 7), (17, 9)])
def test_work_matches_a_token_by_token_count(
    tiny_model_config: ModelConfig, prompt_len: int, output_len: int
) -> None:
    work = request_work(tiny_model_config, prompt_len, output_len)
    assert (work.linear, work.attention) == token_by_token(tiny_model_config, prompt_len, output_len)


def test_a_failed_request_counts_nothing_and_runs_add_up(tiny_model_config: ModelConfig) -> None:
    tiny = tiny_model_config
    assert request_work(tiny, 12, 0).total == 0
    run = run_work(tiny, [3, 5, 12], [2, 1, 0])
    assert run.linear == request_work(tiny, 3, 2).linear + request_work(tiny, 5, 1).linear
    assert run.attention == request_work(tiny, 3, 2).attention + request_work(tiny, 5, 1).attention


def test_the_default_models_per_token_cost() -> None:
    """SmolLM2-135M: 106.2M multiply-adds per token through its 30 layers (docs/BENCHMARKS.md: 212 MFLOP)."""
    cfg = get_preset("smollm2-135m")
    longer, shorter = request_work(cfg, 129, 1), request_work(cfg, 128, 1)
    kv_only = 2 * 576 * 2 * 192
    per_layer = 2 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)
    assert per_layer * 30 == pytest.approx(212.3e6, rel=1e-3)
    assert longer.linear - shorter.linear == 29 * per_layer + kv_only


def _peak_or_skip(threads: int) -> float:
    try:
        return fma_peak_gflops(threads, seconds=0.02, rounds=2)
    except KernelUnavailable as e:
        pytest.skip(f"the FMA loop cannot be built here: {e}")


def test_the_fma_loop_measures_a_plausible_peak() -> None:
    peak = _peak_or_skip(1)
    # one core: more than a scalar loop would do, less than two 512-bit FMA pipes at 6 GHz (384 GFLOPS)
    assert 1.0 < peak < 384.0


def test_cli_prints_each_saved_runs_ceiling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _peak_or_skip(1)
    doc = {
        "label": "cbserve c=16",
        "input_lens": [128] * 4,
        "output_lens": [64, 64, 64, 0],
        "output_throughput": 10.0,
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    argv = [str(path), "--model", "smollm2-135m", "--threads", str(torch.get_num_threads())]
    assert main([*argv, "--seconds", "0.02", "--rounds", "1", "--times", "4"]) == 0
    out = capsys.readouterr().out
    peak = float(re.search(r"FMA peak: ([\d.]+) GFLOPS", out).group(1))  # type: ignore[union-attr]
    ceiling = float(re.search(r"ceiling ([\d.]+) tok/s", out).group(1))  # type: ignore[union-attr]
    work = run_work(get_preset("smollm2-135m"), doc["input_lens"], doc["output_lens"])  # type: ignore[arg-type]

    # NOTE: both numbers are printed to 0.1, which on a busy machine (a low peak) is more than a 0.2% error.
    def ceiling_at(gflops: float) -> float:
        return 192 / (work.total / (gflops * 1e9))

    assert ceiling_at(peak - 0.05) - 0.05 <= ceiling <= ceiling_at(peak + 0.05) + 0.05, (peak, ceiling)
    assert "cbserve c=16: 192 output tokens" in out
    assert "served 10.0 tok/s" in out
    assert "4x that = 40.0 tok/s" in out
