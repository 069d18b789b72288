"""bench/cpu_ceiling.py: the work count against a token-by-token count written out here, the FMA loop, the
ceiling from the work and a peak, and the CLI's printout of a saved run at a fixed peak."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench import cpu_ceiling
from bench.cpu_ceiling import (
    Work,
    ceiling_tok_s,
    floor_seconds,
    fma_peak_gflops,
    kv_read_bytes,
    main,
    memory_floor_seconds,
    request_work,
    run_work,
    weight_bytes,
)
from engine.cpu.native_build import KernelUnavailable
from engine.loader.dummy import get_preset
from engine.model_config import ModelConfig

# a model small enough to count by hand: 3 layers, 2 query heads over 1 KV head of 4
TINY = dataclasses.replace(get_preset("smollm2-135m"), vocab_size=10, hidden_size=8, intermediate_size=16,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=4)  # fmt: skip


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
def test_work_matches_a_token_by_token_count(prompt_len: int, output_len: int) -> None:
    work = request_work(TINY, prompt_len, output_len)
    assert (work.linear, work.attention) == token_by_token(TINY, prompt_len, output_len)


def test_a_failed_request_counts_nothing_and_runs_add_up() -> None:
    assert request_work(TINY, 12, 0).total == 0
    run = run_work(TINY, [3, 5, 12], [2, 1, 0])
    assert run.linear == request_work(TINY, 3, 2).linear + request_work(TINY, 5, 1).linear
    assert run.attention == request_work(TINY, 3, 2).attention + request_work(TINY, 5, 1).attention


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


def test_the_ceiling_is_the_output_tokens_over_the_work_at_the_peak() -> None:
    work = Work(linear=3e12, attention=1e12)
    assert floor_seconds(work, 100.0) == 40.0  # 4e12 flop at 1e11 flop/s
    assert ceiling_tok_s(work, 200, 100.0) == 5.0
    assert ceiling_tok_s(Work(0.0, 0.0), 0, 100.0) == float("inf")


def test_cli_prints_each_saved_runs_ceiling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The printout of a saved run at a fixed peak (the measured one is tested above): exact text, so
    nothing is compared through its rounding."""
    asked: list[tuple[int, float, int]] = []

    def fixed_peak(threads: int, seconds: float, rounds: int) -> float:
        asked.append((threads, seconds, rounds))
        return 50.0

    monkeypatch.setattr(cpu_ceiling, "fma_peak_gflops", fixed_peak)
    monkeypatch.setattr(cpu_ceiling, "memory_bandwidth_gbs", lambda threads, nbytes, rounds: 20.0)
    doc = {
        "label": "cbserve c=16",
        "input_lens": [128] * 4,
        "output_lens": [64, 64, 64, 0],
        "output_throughput": 10.0,
        "max_concurrency": 2,
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    assert (
        main([str(path), "--model", "smollm2-135m", "--threads", "3", "--seconds", "0.02", "--rounds", "1"])
        == 0
    )
    assert asked == [(3, 0.02, 1)]
    cfg = get_preset("smollm2-135m")
    work = run_work(cfg, doc["input_lens"], doc["output_lens"])  # type: ignore[arg-type]
    weights = weight_bytes(cfg, 4)
    ceiling = ceiling_tok_s(work, 192, 50.0)  # compute-bound: 96 steps of 0.54 GB at 20 GB/s take 2.6 s
    assert memory_floor_seconds(192, 2, weights, 20.0) < floor_seconds(work, 50.0)
    kv = kv_read_bytes(cfg, doc["input_lens"], doc["output_lens"], 4)  # type: ignore[arg-type]
    tighter = 192 / max(floor_seconds(work, 50.0), memory_floor_seconds(192, 2, weights, 20.0) + kv / 20e9)
    assert capsys.readouterr().out.splitlines() == [
        "FMA peak: 50.0 GFLOPS on 3 threads (float32, best of 1)",
        f"memory bandwidth: 20.0 GB/s on 3 threads, reading {weights / 1e9:.3f} GB (best of 1)",
        f"cbserve c=16: 192 output tokens, {work.linear / 1e12:.3f} TFLOP of matmuls + "
        f"{work.attention / 1e12:.3f} of attention = {floor_seconds(work, 50.0):.2f} s at the peak; "
        f"96 steps of at most 2 reading {weights / 1e9:.3f} GB of weights = "
        f"{memory_floor_seconds(192, 2, weights, 20.0):.2f} s at 20.0 GB/s: ceiling {ceiling:.1f} tok/s "
        "(compute-bound)",
        f"  served 10.0 tok/s = {100 * 10.0 / ceiling:.0f}% of the ceiling",
        f"  4x that = 40.0 tok/s = {100 * 40.0 / ceiling:.0f}% of the ceiling",
        f"  with the KV cache's reads too ({kv / 1e9:.3f} GB over the run: each fed-back token's keys and values "
        f"in every layer): ceiling {tighter:.1f} tok/s, served {100 * 10.0 / tighter:.0f}% of it",
    ]


@pytest.mark.parametrize("prompt_len,output_len", [(1, 1), (3, 2), (5, 1), (2, 7), (17, 9), (4, 0)])
def test_kv_reads_match_a_token_by_token_count(prompt_len: int, output_len: int) -> None:
    """Each fed-back token (every output token but the last) reads the K and V of every key up to its own
    position, in every layer; the prefill's reads of its own keys are not counted."""
    per_key = 2 * TINY.num_key_value_heads * TINY.head_dim * TINY.num_hidden_layers * 2
    fed_back = range(prompt_len, prompt_len + output_len - 1)  # their positions
    expected = sum((position + 1) * per_key for position in fed_back)
    assert kv_read_bytes(TINY, [prompt_len], [output_len], 2) == expected
    both = kv_read_bytes(TINY, [prompt_len, 3], [output_len, 2], 2)
    assert both == expected + kv_read_bytes(TINY, [3], [2], 2)


def test_a_decode_heavy_run_is_bound_by_reading_the_weights() -> None:
    """SmolLM2-135M in bfloat16: 0.27 GB a step. 2,048 tokens one at a time are 2,048 steps: 27.5 s at
    20 GB/s, far above the compute floor; at 16 a step, 128 steps."""
    cfg = get_preset("smollm2-135m")
    weights = weight_bytes(cfg, 2)
    per_layer = 576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576
    assert weights == 2 * (30 * per_layer + 49152 * 576)
    assert memory_floor_seconds(2048, 1, weights, 20.0) == pytest.approx(2048 * weights / 20e9)
    assert memory_floor_seconds(2048, 16, weights, 20.0) == pytest.approx(128 * weights / 20e9)
    assert memory_floor_seconds(2049, 16, weights, 20.0) == pytest.approx(129 * weights / 20e9)


def test_the_read_loop_measures_a_plausible_bandwidth() -> None:
    try:
        gbs = cpu_ceiling.memory_bandwidth_gbs(1, 64e6, rounds=2)
    except KernelUnavailable as e:
        pytest.skip(f"the read loop cannot be built here: {e}")
    assert 0.5 < gbs < 2000.0  # a core streams at least this much, and no memory is this fast


def test_the_bfloat16_peak_is_its_widest_instructions() -> None:
    """AMX tiles multiply-add far faster than float32 FMAs (16K per instruction); elsewhere the peak is
    that of AVX512-BF16 dot products or, without them, the float32 FMA peak."""
    try:
        peak, kind = cpu_ceiling.bf16_peak_gflops(1, seconds=0.05, rounds=2)
    except KernelUnavailable as e:
        pytest.skip(f"the bfloat16 loop cannot be built here: {e}")
    assert kind in (*cpu_ceiling.BF16_KINDS.values(), "float32 FMA (no bfloat16 instructions)")
    assert peak > 1.0
    if kind == cpu_ceiling.BF16_KINDS[2]:
        assert peak > 2 * _peak_or_skip(1)


def test_cli_takes_the_bfloat16_peak(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        cpu_ceiling, "bf16_peak_gflops", lambda threads, seconds, rounds: (500.0, "AMX-BF16 tiles")
    )
    monkeypatch.setattr(cpu_ceiling, "memory_bandwidth_gbs", lambda threads, nbytes, rounds: 1000.0)
    assert (
        main(["--dtype", "bfloat16", "--model", "smollm2-135m", "--num-prompts", "2", "--threads", "2"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "bfloat16 peak: 500.0 GFLOPS on 2 threads (AMX-BF16 tiles, best of 5)"
    work = run_work(get_preset("smollm2-135m"), [128, 128], [64, 64])
    assert lines[1] == "memory bandwidth: 1000.0 GB/s on 2 threads, reading 0.269 GB (best of 5)"
    assert lines[2].endswith(f"ceiling {ceiling_tok_s(work, 128, 500.0):.1f} tok/s (compute-bound)")


def test_the_stored_blocks_bound_counts_the_ggufs_bytes() -> None:
    """SmolLM2-135M's GGUF: its layers' Q4_1 blocks (20 bytes per 32 weights) and its tied head's Q8_0 (34);
    a dummy preset has none. At 16 a step the blocks' memory floor falls under the compute floor, so the
    bound reading them is compute-bound."""
    cfg = get_preset("smollm2-135m")
    per_layer = 576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576
    stored = cpu_ceiling.stored_weight_bytes("default")
    assert stored == 30 * per_layer * 20 / 32 + 49152 * 576 * 34 / 32
    assert cpu_ceiling.stored_weight_bytes("smollm2-135m") is None
    work = run_work(cfg, [128] * 32, [64] * 32)
    machine = cpu_ceiling.Machine(2000.0, 25.0)
    text = cpu_ceiling.report("run", work, 2048, (16, weight_bytes(cfg, 2)), machine, 700.0, 4.0, stored)
    bound = 2048 / floor_seconds(work, 2000.0)
    assert memory_floor_seconds(2048, 16, stored, 25.0) < floor_seconds(work, 2000.0)
    assert text.splitlines()[-1] == (
        f"  reading the checkpoint's blocks instead ({stored / 1e9:.3f} GB a step, as cbserve's bfloat16 decode "
        f"steps of up to 32 rows on AMX, 12 on AVX512-BF16 do): bound {bound:.1f} tok/s, served "
        f"{100 * 700.0 / bound:.0f}% of it"
    )
