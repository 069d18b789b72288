"""The AVX512-BF16 matmul kernel (engine/executor/kernels/bf16_gemm.py, csrc/bf16_gemm.c), on CPUs that have
those dot products (it skips elsewhere): its packed layout, its outputs against a float64 reference rounded
to bfloat16 (odd K, a last panel of a few outputs, bias or none; calls of one row to prefill sizes, on both
of its paths), a row's bits the same alone and in any call, its float32 outputs the bfloat16 ones widened,
and its SwiGLU call the bits of the matmul then the gate."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.native_build import KernelUnavailable
from engine.executor.kernels import bf16_gemm, cpu_ops
from engine.executor.kernels.bf16_gemm import Bf16Gemm


@pytest.fixture(scope="module")
def gemm() -> Bf16Gemm:
    try:
        return bf16_gemm.load()
    except KernelUnavailable as e:
        pytest.skip(f"the AVX512-BF16 kernel cannot run here: {e}")


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    return x, w, b


def test_the_packed_layout_is_panels_of_k_pairs() -> None:
    w = torch.arange(33 * 5, dtype=torch.float32).view(33, 5).to(torch.bfloat16)
    packed = Bf16Gemm.pack(w)
    assert packed.shape == (3, 3, 16, 2) == Bf16Gemm.packed_shape(33, 5)
    assert torch.equal(packed[1, 2, 3, 0], w[19, 4]) and torch.equal(packed[0, 1, 7], w[7, 2:4])
    assert bool((packed[2, :, 1:] == 0).all()) and bool((packed[:, 2, :, 1] == 0).all())  # the padding


@pytest.mark.parametrize(("m", "n", "k"), [(1, 33, 577), (12, 40, 64), (13, 576, 576), (16, 40, 65),
                                           (30, 72, 64), (64, 100, 1536), (65, 48, 96), (300, 200, 577)])  # fmt: skip
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_outputs_are_the_float64_product_rounded_to_bfloat16(
    gemm: Bf16Gemm, m: int, n: int, k: int, bias: bool
) -> None:
    """Within a bfloat16 step of the float64 reference (the float32 chain's error is far below it), every
    output; the rows of one call the same bits as each computed alone."""
    x, w, b = _operands(m, n, k, seed=m + n + k)
    out = gemm.linear(x, gemm.pack(w), n, b if bias else None)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    reference = x.double() @ w.double().T + (b.double() if bias else 0.0)
    chain_error = (x.double().abs() @ w.double().abs().T) * k * 2.0**-24
    step = reference.abs() * 2.0**-8 + chain_error + 1e-30  # half a bfloat16 step and the chain's rounding
    assert bool(((out.double() - reference).abs() <= step).all())
    packed = gemm.pack(w)
    for row in sorted({0, m // 2, m - 1}):
        alone = gemm.linear(x[row : row + 1], packed, n, b if bias else None)
        assert torch.equal(alone, out[row : row + 1])


def test_a_row_is_the_same_bits_in_a_decode_sized_call_and_a_prefill_sized_one(gemm: Bf16Gemm) -> None:
    """The threads share out the panels up to 64 rows and split the rows past it: a row's chain is the
    same either way, at any place in its block of 12."""
    x, w, b = _operands(400, 576, 576, seed=3)
    packed = gemm.pack(w)
    big = gemm.linear(x, packed, 576, b)
    for lo, hi in ((0, 16), (5, 69), (100, 112), (390, 400)):
        assert torch.equal(gemm.linear(x[lo:hi], packed, 576, b), big[lo:hi])


def test_float32_outputs_are_the_rounded_values_widened(gemm: Bf16Gemm) -> None:
    """An output head's logits: the kernel writes the bfloat16 outputs as float32, the same values."""
    x, w, b = _operands(20, 200, 64, seed=4)
    packed = gemm.pack(w)
    wide = gemm.linear(x, packed, 200, b, torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide, gemm.linear(x, packed, 200, b).float())


def test_bad_operands_are_refused(gemm: Bf16Gemm) -> None:
    x, w, b = _operands(4, 32, 64, seed=5)
    packed = gemm.pack(w)
    with pytest.raises(ValueError, match="does not fit"):
        gemm.linear(x[:, :62], packed, 32, None)
    with pytest.raises(ValueError, match="bfloat16 CPU rows"):
        gemm.linear(x.float(), packed, 32, None)
    with pytest.raises(ValueError, match="bias"):
        gemm.linear(x, packed, 32, b[:16])
    with pytest.raises(ValueError, match="2-D bfloat16"):
        Bf16Gemm.pack(w.float())


@pytest.mark.parametrize("m", [1, 5, 12, 13, 16, 32, 64, 65, 300])
@pytest.mark.parametrize(("inter", "k"), [(48, 64), (1536, 576), (32, 33)])
def test_swiglu_is_the_bits_of_the_matmul_then_the_gate(gemm: Bf16Gemm, m: int, inter: int, k: int) -> None:
    """``swiglu``: the projection and SwiGLU's gate in one call, each register block over a gate panel and
    its up panel, gives the bits of ``linear`` then the fused ops' ``silu_and_mul`` (an odd number of gate
    panels, odd K; calls of both paths)."""
    try:
        ops = cpu_ops.load()
    except KernelUnavailable as e:
        pytest.skip(f"the fused CPU ops cannot run here: {e}")
    x, w, _ = _operands(m, 2 * inter, k, seed=m + inter)
    x = x * 4  # gates across silu's curve
    packed = gemm.pack(w)
    expected = ops.silu_and_mul(gemm.linear(x, packed, 2 * inter, None))
    assert torch.equal(gemm.swiglu(x, packed, inter).view(torch.int16), expected.view(torch.int16))
    with pytest.raises(ValueError, match="gate and up"):
        gemm.swiglu(x, packed, inter + 16)
