"""The fused CPU ops (engine/executor/kernels/cpu_ops.py) against the PyTorch path of engine/executor/models/layers.py: the
same values (bfloat16: the same bits where PyTorch's rounding is replicated), row tails that are not a
multiple of the SIMD width, strided inputs, NaN, argument checks, and the model's fallback."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from default_engine import engine_on

from engine.cpu.native_build import KernelUnavailable
from engine.engine import Engine
from engine.executor import fast_paths
from engine.executor.kernels import cpu_ops
from engine.executor.kernels.cpu_ops import CpuOps
from engine.executor.kernels.modules import FusedRMSNorm, FusedRotaryEmbedding
from engine.executor.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, SiluAndMul
from engine.executor.models.registry import build_model
from engine.loader.dummy import get_preset
from engine.loader.model_loader import LoadedModel

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops() -> CpuOps:
    try:
        return cpu_ops.load()
    except KernelUnavailable as e:
        pytest.skip(f"the CPU ops cannot be built here: {e}")


def _close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    else:  # a one-ulp flip where libm's expf and torch's exp round differently
        torch.testing.assert_close(ours.float(), ref.float(), rtol=2**-7, atol=1e-3)


def _norm(dim: int, dtype: torch.dtype, gen: torch.Generator, scale_in_float32: bool = False) -> RMSNorm:
    norm = RMSNorm(dim, 1e-5, dtype, CPU, scale_in_float32)
    norm.weight.data.copy_(torch.rand(dim, generator=gen) + 0.5)
    return norm


@pytest.mark.parametrize("scale_in_float32", [False, True], ids=["weight-in-dtype", "float32-weight"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [64, 40, 7])
def test_rms_norm_with_and_without_the_residual_matches_pytorch(
    ops: CpuOps, dtype: torch.dtype, cols: int, scale_in_float32: bool
) -> None:
    """Both forms, and PyTorch's path, within rounding of a float64 reference: the float32 sum of squares
    (gamma(cols), Higham 3.1) and at most 16 ulp for the ops after it (eps, the square root, its reciprocal
    -- 2 ulp where -ffast-math uses rsqrt -- and two products), plus, in bfloat16, the two roundings to
    bfloat16 of csrc/cpu_ops.c (Llama's order), or the one of a float32 weight (Gemma's: scaled, then
    rounded). Bits are asserted only for IEEE-defined results and between our own calls.
    NOTE: with and without the residual may differ in the last bits: -ffast-math lets the compiler order
    the two sums of squares differently (it does at 7 columns on AVX-512)."""
    gen = torch.Generator().manual_seed(cols)
    norm = _norm(cols, dtype, gen, scale_in_float32)
    wide = (torch.randn(9, cols + 5, generator=gen) * 3).to(dtype)
    x = wide[:, :cols]  # rows with a stride
    residual = torch.randn(9, cols, generator=gen).to(dtype)
    h = (residual.float() + x.float()).to(dtype)  # one float32 add, rounded to dtype: IEEE's bits

    out = ops.rms_norm(x, norm.weight, norm.eps, residual)
    assert torch.equal(residual, h)  # updated in place
    plain = ops.rms_norm(h, norm.weight, norm.eps)
    for row in range(h.shape[0]):  # a row alone: the bits it gets in the batch
        assert torch.equal(ops.rms_norm(h[row : row + 1], norm.weight, norm.eps), plain[row : row + 1]), row

    h64, w64 = h.double(), norm.weight.double()
    exact = w64 * h64 / torch.sqrt(h64.square().mean(-1, keepdim=True) + norm.eps)
    rtol = (cols + 16) * 2.0**-24 / (1 - (cols + 16) * 2.0**-24)
    if dtype == torch.bfloat16:
        rtol += (1 if scale_in_float32 else 2) * 2.0**-8
    for ours in (out, plain, norm(h)):  # norm(h): no cpu_ops on the module, PyTorch's path
        error = (ours.double() - exact).abs()
        assert bool((error <= rtol * exact.abs()).all()), (
            f"{(error / (rtol * exact.abs())).max():.3g}x the bound"
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [96, 21])
def test_silu_and_mul_matches_pytorch(ops: CpuOps, dtype: torch.dtype, inter: int) -> None:
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(5, 2 * inter, generator=gen) * 6).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)
    _close(ops.silu_and_mul(gate_up), F.silu(gate) * up, dtype)


def _silu64(g: torch.Tensor) -> torch.Tensor:
    return g / (1 + torch.exp(-g))


def _gelu_tanh64(g: torch.Tensor) -> torch.Tensor:
    """g / 2 * (1 + tanh(u)) as g / (1 + exp(-2u)): no cancellation where tanh(u) is near -1"""
    return g / (1 + torch.exp(-1.5957691216057308 * (g + 0.044715 * g**3)))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("inter", [65536, 65536 - 7])  # the vector lanes and the scalar tail
def test_bfloat16_activation_of_every_gate_is_the_float64_one_rounded(
    ops: CpuOps, act: str, inter: int
) -> None:
    """bfloat16 SiLU and GELU-tanh are looked up in tables of all 65,536 gates (csrc/activation_tables.h):
    every gate's entry is the activation computed in float64, rounded to float32 then to bfloat16 (times an
    up of 1, rounded again: where that product is a float32 denormal the rounding flushes it to zero);
    +inf -> +inf, -inf -> NaN, NaN -> NaN."""
    bits = torch.arange(65536, dtype=torch.int32)[-inter:]
    gate = (bits - 65536 * (bits >= 32768)).to(torch.int16).view(torch.bfloat16)  # every bit pattern
    gate_up = torch.cat([gate, torch.ones(inter, dtype=torch.bfloat16)]).unsqueeze(0)
    out = (ops.silu_and_mul if act == "silu" else ops.gelu_tanh_and_mul)(gate_up)[0].float()
    g = gate.double()
    with torch.no_grad():
        ref = (_silu64 if act == "silu" else _gelu_tanh64)(g).float()
    want = ref.bfloat16().float()
    normal = want.abs() >= torch.finfo(torch.float32).tiny
    finite = torch.isfinite(g)
    assert torch.equal(out[finite & normal], want[finite & normal])
    assert (out[finite & ~normal] == 0).all()  # zero, or a denormal flushed by the product's rounding
    assert torch.isnan(out[torch.isnan(g) | (g == float("-inf"))]).all()
    assert (out[g == float("inf")] == float("inf")).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [96, 21])
def test_gelu_tanh_and_mul_matches_pytorch(ops: CpuOps, dtype: torch.dtype, inter: int) -> None:
    """Gemma's gate: ``gelu(gate, approximate="tanh") * up``."""
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(5, 2 * inter, generator=gen) * 6).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)
    _close(ops.gelu_tanh_and_mul(gate_up), F.gelu(gate, approximate="tanh") * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 16, 24])
def test_rotary_in_place_matches_pytorch(ops: CpuOps, dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None, dtype, CPU)
    heads, kv_heads, tokens = 4, 2, 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)  # strided tokens
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    ref = rotary.rotate(qk, *rotary.cos_sin(positions))

    ops.rotary(qk, positions, rotary.cos, rotary.sin_signed)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # v untouched
    if dtype == torch.bfloat16:
        assert torch.equal(qk, ref)
    else:
        _close(qk, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_stays_nan(ops: CpuOps, dtype: torch.dtype) -> None:
    x = torch.ones(2, 48, dtype=dtype)
    x[1, 5] = float("nan")
    out = ops.rms_norm(x, torch.ones(48, dtype=dtype), 1e-5)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()
    gate_up = torch.ones(2, 96, dtype=dtype)
    gate_up[1, 50] = float("nan")
    out = ops.silu_and_mul(gate_up)
    assert torch.isnan(out[1, 2]) and torch.isfinite(out[0]).all() and torch.isfinite(out[1, 3:]).all()


def test_bad_arguments_are_refused(ops: CpuOps) -> None:
    w = torch.ones(8)
    with pytest.raises(ValueError, match="one dtype"):  # a weight in another dtype than float32
        ops.rms_norm(torch.ones(2, 8), w.bfloat16(), 1e-5)
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        ops.silu_and_mul(torch.ones(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="2-D"):
        ops.rms_norm(torch.ones(2, 3, 8), w, 1e-5)
    with pytest.raises(ValueError, match="residual"):
        ops.rms_norm(torch.ones(2, 8), w, 1e-5, torch.ones(3, 8))
    with pytest.raises(ValueError, match="even"):
        ops.silu_and_mul(torch.ones(2, 7))
    with pytest.raises(ValueError, match="int64"):
        ops.rotary(torch.ones(2, 1, 8), torch.zeros(2, dtype=torch.int32), torch.ones(4, 8), torch.ones(4, 8))


def test_positions_past_the_rotary_table_raise_before_the_ops_read_it(ops: CpuOps) -> None:
    rotary = FusedRotaryEmbedding(RotaryEmbedding(16, 32, 10000.0, None, torch.float32, CPU), ops)
    with pytest.raises(IndexError, match="outside the rotary table"):
        rotary.prepare(torch.tensor([3, 32]))


def test_modules_use_the_ops_only_where_they_apply(ops: CpuOps) -> None:
    """Per-head (3-D) norms of Qwen3 and Gemma 3, on a strided view of the fused projection as the attention
    passes them, take the op one head a row, as the decode stack does (the same bits)."""
    gen = torch.Generator().manual_seed(0)
    norm = _norm(16, torch.float32, gen)
    qkv = torch.randn(3, 8 * 16, generator=gen)
    x = qkv.view(3, 8, 16)[:, 2:6]  # [tokens, heads, head_dim], tokens strided
    ref = norm(x)
    fused = FusedRMSNorm(norm, ops)(x)
    torch.testing.assert_close(fused, ref)
    assert torch.equal(fused, ops.rms_norm(x.reshape(12, 16), norm.weight, norm.eps).view(3, 4, 16))
    mlp = GatedMLP(16, 24, torch.float32, CPU)
    assert type(mlp.act_fn) is SiluAndMul  # a module is plain PyTorch until the fast paths swap it


def test_a_model_without_the_ops_runs_pytorch_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    small = dataclasses.replace(get_preset("smollm2-135m"), vocab_size=64, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    model = build_model(small, torch.float32, CPU)

    def unavailable() -> CpuOps:
        raise KernelUnavailable("no C compiler (cc or gcc) on PATH")

    monkeypatch.setattr(cpu_ops, "load", unavailable)
    with caplog.at_level(logging.WARNING, logger=fast_paths.__name__):
        assert fast_paths.swap_fused_ops(model) is None
    assert "no C compiler" in caplog.text
    assert not any(isinstance(m, FusedRMSNorm | FusedRotaryEmbedding) for m in model.modules())
    assert fast_paths.swap_fused_ops(build_model(small, torch.float16, CPU)) is None


@pytest.mark.slow
def test_engine_greedy_outputs_are_the_same_with_and_without_the_ops(
    ops: CpuOps, default_model: LoadedModel
) -> None:
    """The public API end to end on the default model: the engine's CPU path (prepacked weights, fused ops)
    and the PyTorch path (dense weights, no ops) generate the same greedy tokens."""
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4, 5,"]
    outputs = []
    for fast in (True, False):
        # the session's default model has the fast paths in: the other path needs its own load
        engine = (
            engine_on(default_model)
            if fast
            else Engine.from_pretrained("default", device="cpu", dtype="float32", prepack_weights=False)
        )
        assert isinstance(engine.model.rotary, FusedRotaryEmbedding) is fast
        ids = [engine.tokenizer.encode(p) for p in prompts]
        results = engine.generate_batch(ids, progress_bar=False, max_new_tokens=24, do_sample=False)
        outputs.append([r.generated_ids for r in results.values()])
    assert outputs[0] == outputs[1]
