"""The float32 small-batch matmul kernel (engine/executor/kernels/small_gemm.py): within float32 rounding of a
float64 reference at the model's shapes, output tails that are not a multiple of the panel and k past one
1024 block; the same bits for a row whatever its batch; strided rows, bias and argument checks (its use by the model: tests/model/test_fast_paths.py). NOTE: oneDNN is never the reference for bits: it picks other kernels on other CPUs."""

from __future__ import annotations

import pytest
import torch

from engine.cpu.native_build import KernelUnavailable
from engine.executor.kernels import small_gemm
from engine.executor.kernels.small_gemm import SmallGemm

CPU = torch.device("cpu")
UNIT_ROUNDOFF = 2.0**-24  # float32


@pytest.fixture(scope="module")
def kernel() -> SmallGemm:
    try:
        return small_gemm.load()
    except KernelUnavailable as e:
        pytest.skip(f"the small-batch matmul kernel cannot be built here: {e}")


def assert_within_rounding(
    ours: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> None:
    """``ours`` is ``x W^T + b`` up to float32 rounding: for each output, a sum of k products and a bias
    computed in float32 in any order is off the exact value by at most gamma(k + 1) * (|x| |W|^T + |b|),
    gamma(n) = n u / (1 - n u) (Higham, Accuracy and Stability of Numerical Algorithms, 3.1). The float64
    reference is exact up to 2^-29 of that bound (its products are exact, its sums round at 2^-53)."""
    x64, w64 = x.double(), w.double()
    b64 = torch.zeros(w.shape[0], dtype=torch.float64) if b is None else b.double()
    n = x.shape[-1] + 1
    gamma = n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)
    bound = gamma * (x64.abs() @ w64.abs().T + b64.abs())
    error = (ours.double() - (x64 @ w64.T + b64)).abs()
    assert ours.shape == error.shape and bool((error <= bound).all()), (
        f"{(error / bound).max():.3g}x the bound"
    )


# (out_features, in_features): the model's projections, a tail of 4 outputs, and k past one 1024 block
SHAPES = [(960, 576), (576, 1536), (100, 300), (20, 2500)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [1, 5, 6, 7, 16, 17, 24, 25, 64, 65, 130])
def test_matches_a_float64_reference_within_float32_rounding(
    kernel: SmallGemm, n: int, k: int, m: int
) -> None:
    gen = torch.Generator().manual_seed(n * 7 + m)
    w, b = torch.randn(n, k, generator=gen) * 0.05, torch.randn(n, generator=gen)
    x = torch.randn(m, k, generator=gen)
    packed = kernel.pack(w)
    assert_within_rounding(kernel.linear(x, packed, n, None), x, w, None)
    assert_within_rounding(kernel.linear(x, packed, n, b), x, w, b)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_a_rows_result_does_not_depend_on_the_batch(kernel: SmallGemm, n: int, k: int) -> None:
    """Few rows read the panel in short chunks of k, many in one pass (csrc/small_gemm.c): the FMA chains
    are the same, so each row gets the same bits at every batch size."""
    gen = torch.Generator().manual_seed(n + k)
    w, b = kernel.pack(torch.randn(n, k, generator=gen) * 0.05), torch.randn(n, generator=gen)
    x = torch.randn(140, k, generator=gen)
    whole = kernel.linear(x, w, n, b)
    for m in (1, 6, 23, 24, 25, 64, 65, 139):
        assert torch.equal(kernel.linear(x[:m], w, n, b), whole[:m]), m
    for row in (0, 5, 63, 64, 139):  # one row alone, from every register block and row group
        assert torch.equal(kernel.linear(x[row : row + 1], w, n, b), whole[row : row + 1]), row


def test_bias_and_strided_rows(kernel: SmallGemm) -> None:
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(37, 64, generator=gen), torch.randn(37, generator=gen)
    x = torch.randn(9, 100, generator=gen)[:, 10:74]  # rows 100 apart
    ours = kernel.linear(x, kernel.pack(w), 37, b)
    assert_within_rounding(ours, x, w, b)
    assert torch.equal(ours, kernel.linear(x.contiguous(), kernel.pack(w), 37, b))


def test_pack_layout(kernel: SmallGemm) -> None:
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    packed = kernel.pack(w)
    assert packed.shape == (2, 3, 16)
    assert torch.equal(packed[0], w[:16].T) and torch.equal(packed[1, :, :4], w[16:].T)
    assert not packed[1, :, 4:].any()  # zero-padded past the last output


def test_bad_arguments_are_refused(kernel: SmallGemm) -> None:
    packed = kernel.pack(torch.randn(16, 8))
    with pytest.raises(ValueError):
        kernel.linear(torch.randn(2, 9), packed, 16, None)  # wrong in_features
    with pytest.raises(ValueError):
        kernel.linear(torch.randn(2, 8, dtype=torch.bfloat16), packed, 16, None)
    with pytest.raises(ValueError):
        kernel.linear(torch.randn(8, 2).T, packed, 16, None)  # columns not contiguous
    with pytest.raises(ValueError):
        kernel.linear(torch.randn(2, 8), packed, 17, None)  # more outputs than packed
    with pytest.raises(ValueError):
        kernel.pack(torch.randn(16, 8, dtype=torch.bfloat16))
