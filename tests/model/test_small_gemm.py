"""The float32 small-batch matmul kernel (engine/executor/kernels/small_gemm.py): the same bits as the oneDNN prepacked
matmul it replaces for decode steps (its k order and 1024-wide k blocks), output tails that are not a
multiple of the panel, strided rows, bias and argument checks. Its use by the model: tests/model/test_fast_paths.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cpu.native_build import KernelUnavailable
from engine.executor.kernels import prepacked, small_gemm
from engine.executor.kernels.small_gemm import SmallGemm

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel() -> SmallGemm:
    try:
        return small_gemm.load()
    except KernelUnavailable as e:
        pytest.skip(f"the small-batch matmul kernel cannot be built here: {e}")


# (out_features, in_features): the model's projections, a tail of 4 outputs, and k past one 1024 block
SHAPES = [(960, 576), (576, 1536), (100, 300), (20, 2500)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [1, 5, 6, 7, 16, 17, 24, 25, 64, 65, 130])
def test_matches_onednn_bit_for_bit_and_f_linear_closely(kernel: SmallGemm, n: int, k: int, m: int) -> None:
    gen = torch.Generator().manual_seed(n * 7 + m)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(m, k, generator=gen)
    ours = kernel.linear(x, kernel.pack(w), n, None)
    torch.testing.assert_close(ours, F.linear(x, w), rtol=1e-4, atol=1e-4)
    if prepacked.can_prepack(CPU, torch.float32):
        assert torch.equal(ours, prepacked.linear(x, prepacked.prepack(w), None))


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


def test_bias_and_strided_rows(kernel: SmallGemm) -> None:
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(37, 64, generator=gen), torch.randn(37, generator=gen)
    x = torch.randn(9, 100, generator=gen)[:, 10:74]  # rows 100 apart
    ours = kernel.linear(x, kernel.pack(w), 37, b)
    torch.testing.assert_close(ours, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


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
