"""The bfloat16 AMX matmul kernel (engine/executor/kernels/amx_gemm.py), where the CPU has AMX-BF16: within
float32-accumulation rounding of a float64 reference plus the one rounding of the output to bfloat16, at the
model's shapes, from one row to prefill sizes and at tails of rows and outputs; a row's bits do not depend on
the rows beside it, on how the call's rows are laid out (read in place or packed), nor on the threads;
argument checks; SwiGLU's projection and gate in one call, the bits of the two. Its use by the model: tests/model/test_fast_paths.py and tests/engine/test_batch_invariance.py."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.native_build import KernelUnavailable
from engine.executor.kernels import amx_gemm, cpu_ops
from engine.executor.kernels.amx_gemm import AmxGemm

FLOAT32_ROUNDOFF = 2.0**-24
BF16_ROUNDOFF = 2.0**-8


@pytest.fixture(scope="module")
def kernel() -> AmxGemm:
    try:
        return amx_gemm.load()
    except KernelUnavailable as e:
        pytest.skip(f"the AMX kernel cannot run here: {e}")


def assert_within_rounding(
    ours: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> None:
    """bfloat16 inputs multiply exactly in float32; the k products and the bias summed in float32 in any
    order are off by at most gamma(k + 1) (|x| |W|^T + |b|) (Higham 3.1); then one rounding to bfloat16."""
    x64, w64 = x.double(), w.double()
    b64 = torch.zeros(w.shape[0], dtype=torch.float64) if b is None else b.double()
    exact = x64 @ w64.T + b64
    n = x.shape[-1] + 1
    gamma = n * FLOAT32_ROUNDOFF / (1 - n * FLOAT32_ROUNDOFF)
    accumulated = gamma * (x64.abs() @ w64.abs().T + b64.abs())
    bound = accumulated + BF16_ROUNDOFF * (exact.abs() + accumulated)
    error = (ours.double() - exact).abs()
    assert ours.dtype == torch.bfloat16 and bool((error <= bound).all()), (
        f"{(error / bound).max():.3g}x the bound"
    )


# (out_features, in_features): the default model's projections (qkv, o, gate/up, down), outputs that are not
# a multiple of the 32 of a block or the 64 of a work item, and the smallest k
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
SHAPES = [*MODEL_SHAPES, (100, 64), (1000, 96), (150, 64)]  # 150: three groups of 64, shared as halves


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [1, 5, 16, 17, 31, 32, 33, 100, 255, 300])
def test_matches_a_float64_reference_within_rounding(kernel: AmxGemm, n: int, k: int, m: int) -> None:
    gen = torch.Generator().manual_seed(n * 7 + m)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    packed = kernel.pack(w)
    assert_within_rounding(kernel.linear(x, packed, n, None), x, w, None)
    assert_within_rounding(kernel.linear(x, packed, n, b), x, w, b)


@pytest.mark.parametrize("m", [2048, 2047])
def test_matches_a_float64_reference_at_prefill_sizes(kernel: AmxGemm, m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    n, k = 960, 576
    w, b = (torch.randn(n, k, generator=gen) * 0.05).bfloat16(), torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    assert_within_rounding(kernel.linear(x, kernel.pack(w), n, b), x, w, b)


@pytest.mark.parametrize(("n", "k"), MODEL_SHAPES)
def test_a_row_is_the_same_bits_in_any_batch(kernel: AmxGemm, n: int, k: int) -> None:
    """Alone, in a tile of 16 rows, in blocks of 32 rows split over the outputs or over the rows, in a later
    chunk of 256 rows and at the tail of a call: the same bits."""
    gen = torch.Generator().manual_seed(n + k)
    w, b = (torch.randn(n, k, generator=gen) * 0.05).bfloat16(), torch.randn(n, generator=gen).bfloat16()
    packed = kernel.pack(w)
    row = torch.randn(1, k, generator=gen).bfloat16()
    alone = kernel.linear(row, packed, n, b)[0]
    for m, at in ((16, 7), (17, 16), (64, 40), (129, 128), (255, 3), (300, 299), (1001, 600), (2048, 1000)):
        x = torch.randn(m, k, generator=gen).bfloat16()
        x[at] = row[0]
        assert torch.equal(kernel.linear(x, packed, n, b)[at], alone), (m, at)


@pytest.mark.parametrize("m", [5, 16, 40, 300, 2048])
def test_the_bits_do_not_depend_on_the_threads_or_the_rows_layout(kernel: AmxGemm, m: int) -> None:
    """One thread or two (up to 16 rows, 576 outputs: nine groups of 64 on one thread, 18 halves on two);
    rows read in place (contiguous, on cache lines) or packed first (a row stride that is not a multiple of
    32, a start off a cache line): the same bits."""
    gen = torch.Generator().manual_seed(m)
    n, k = 576, 1536
    w, b = (torch.randn(n, k, generator=gen) * 0.05).bfloat16(), torch.randn(n, generator=gen).bfloat16()
    packed = kernel.pack(w)
    wide = torch.randn(m + 1, k + 8, generator=gen).bfloat16()
    x = wide[1:, 3 : 3 + k]  # rows k + 8 apart, starting 6 bytes into a cache line
    expected = kernel.linear(x.contiguous(), packed, n, b)
    assert torch.equal(kernel.linear(x, packed, n, b), expected)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(kernel.linear(x.contiguous(), packed, n, b), expected), count
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("m", [1, 40])
def test_a_sum_in_float32_denormals_rounds_as_torch_does(kernel: AmxGemm, m: int) -> None:
    """2^-125 from the tiles plus a bias of -15/16 of it: 2^-129, a float32 denormal, kept as a bfloat16
    denormal as torch's conversion keeps it (AVX512-BF16's conversion would flush it to zero)."""
    n, k = 40, 64
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    w[:, 0] = 2.0**-63
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    x[:, 0] = 2.0**-62
    b = torch.full((n,), -(2.0**-125) * 15 / 16).bfloat16()
    expected = torch.tensor(2.0**-129, dtype=torch.float32).bfloat16()
    assert expected.item() != 0.0
    out = kernel.linear(x, kernel.pack(w), n, b)
    assert torch.equal(out, expected.expand(m, n))


def test_strided_rows_and_leading_dimensions(kernel: AmxGemm) -> None:
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(130, 64, generator=gen) * 0.05).bfloat16()
    packed = kernel.pack(w)
    wide = torch.randn(40, 100, generator=gen).bfloat16()
    x = wide[:, 10:74]  # rows 100 apart
    expected = kernel.linear(x.contiguous(), packed, 130, None)
    assert torch.equal(kernel.linear(x, packed, 130, None), expected)
    batched = x.reshape(4, 10, 64)
    assert torch.equal(kernel.linear(batched, packed, 130, None), expected.view(4, 10, 130))


def test_refuses_what_it_cannot_compute(kernel: AmxGemm) -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        kernel.pack(torch.zeros(16, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        kernel.pack(torch.zeros(16, 64))
    packed = kernel.pack(torch.zeros(16, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        kernel.linear(torch.zeros(2, 96, dtype=torch.bfloat16), packed, 16, None)
    with pytest.raises(ValueError, match="bfloat16 CPU rows"):
        kernel.linear(torch.zeros(2, 64), packed, 16, None)


# (inter, k): the default model's MLP, an inter whose gate and up halves leave padded tile columns (48: the
# weight's 96 rows pad to 128), and a third k
@pytest.mark.parametrize(("inter", "k"), [(1536, 576), (48, 64), (64, 96)])
@pytest.mark.parametrize("m", [1, 16, 33, 300, 1024, 1100])
def test_swiglu_gives_the_bits_of_the_matmul_then_the_fused_gate(
    kernel: AmxGemm, inter: int, k: int, m: int
) -> None:
    """One call for SwiGLU's projection and gate: the bits of ``linear`` then ``CpuOps.silu_and_mul``,
    whichever way the threads split the call (outputs below 1,024 rows, rows from there)."""
    try:
        ops = cpu_ops.load()
    except KernelUnavailable as e:
        pytest.skip(f"the fused ops cannot be built here: {e}")
    gen = torch.Generator().manual_seed(inter + m)
    w = (torch.randn(2 * inter, k, generator=gen) * 0.1).bfloat16()
    x = torch.randn(m, k, generator=gen).bfloat16()
    packed = kernel.pack(w)
    separate = ops.silu_and_mul(kernel.linear(x, packed, 2 * inter, None))
    assert torch.equal(kernel.swiglu(x, packed, inter).view(torch.int16), separate.view(torch.int16))


def test_swiglu_refuses_what_it_cannot_compute(kernel: AmxGemm) -> None:
    packed = kernel.pack(torch.zeros(48, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel.swiglu(torch.zeros(2, 64, dtype=torch.bfloat16), packed, 24)
    with pytest.raises(ValueError, match="does not fit"):
        kernel.swiglu(torch.zeros(2, 64, dtype=torch.bfloat16), packed, 48)
