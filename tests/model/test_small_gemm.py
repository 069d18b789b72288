"""The float32 small-batch matmul kernel (engine/executor/kernels/small_gemm.py): within float32 rounding of a
float64 reference at the model's shapes, output tails that are not a multiple of the panel and k past one
1024 block; the same bits for a row whatever its batch; strided rows, bias, argument checks, and its use by
the model. NOTE: oneDNN is never the reference for bits: it picks other kernels on other CPUs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.cpu.native_build import KernelUnavailable
from engine.executor.inputs import BatchInputs
from engine.executor.kernels import prepacked, small_gemm
from engine.executor.kernels.small_gemm import SmallGemm
from engine.executor.kv_cache import KVCache
from engine.executor.models.layers import Linear
from engine.executor.models.registry import build_model
from engine.loader.dummy import get_preset

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


def _loaded_linear() -> tuple[Linear, torch.Tensor, torch.Tensor]:
    """A 32 -> 48 Linear with a bias, loaded with random weights: (layer, W, b)."""
    lin = Linear(32, 48, True, torch.float32, CPU)
    w, b = torch.randn(48, 32), torch.randn(48)
    with torch.no_grad():
        lin.weight.copy_(w)
        assert lin.bias is not None
        lin.bias.copy_(b)
    return lin, w, b


def _count_kernel_calls(kernel: SmallGemm, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of every ``kernel.linear`` call from now on."""
    calls: list[int] = []
    real = kernel.linear

    def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(kernel, "linear", counted)
    return calls


def test_linear_uses_the_kernel_for_few_rows_only(kernel: SmallGemm, monkeypatch: pytest.MonkeyPatch) -> None:
    if not prepacked.can_prepack(CPU, torch.float32):
        pytest.skip("this torch build cannot prepack weights (no oneDNN)")
    lin, w, b = _loaded_linear()
    lin.prepack(kernel)
    calls = _count_kernel_calls(kernel, monkeypatch)
    for m in (1, small_gemm.MAX_ROWS, small_gemm.MAX_ROWS + 1):
        x = torch.randn(m, 32)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert calls == [1, small_gemm.MAX_ROWS]  # more rows than MAX_ROWS go to oneDNN


def test_without_onednn_every_call_goes_to_the_kernel(
    kernel: SmallGemm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the kernel takes every batch, a prepacked Linear keeps only its panels and serves any row count,
    3-D inputs and strided ones."""
    if not prepacked.can_prepack(CPU, torch.float32):
        pytest.skip("this torch build cannot prepack weights (no oneDNN)")
    lin, w, b = _loaded_linear()
    lin.prepack(kernel, onednn=False)
    assert lin.packed is None and lin.weight.numel() == 0 and lin.is_prepacked
    calls = _count_kernel_calls(kernel, monkeypatch)
    for x in (torch.randn(1, 32), torch.randn(300, 32), torch.randn(3, 5, 32), torch.randn(32, 7).T):
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert calls == [1, 300, 15, 7]


@pytest.mark.parametrize("onednn_copy", [True, False], ids=["with-onednn", "kernel-only"])
def test_model_logits_with_and_without_the_kernel(
    kernel: SmallGemm, monkeypatch: pytest.MonkeyPatch, onednn_copy: bool
) -> None:
    """A float32 prepacked model uses the kernel for a decode step (and its output head); its prefill and
    decode logits equal the dense model's up to float rounding, and with oneDNN's copy kept (AVX-512 CPUs)
    the same step through oneDNN alone gives them too. bfloat16 models never use it."""
    if not prepacked.can_prepack(CPU, torch.float32):
        pytest.skip("this torch build cannot prepack weights (no oneDNN)")
    monkeypatch.setattr(small_gemm, "takes_every_batch", lambda: not onednn_copy)
    cfg = dataclasses.replace(get_preset("smollm2-135m"), vocab_size=200, hidden_size=64, intermediate_size=160,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    model, dense = build_model(cfg, torch.float32, CPU), build_model(cfg, torch.float32, CPU)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p, q in zip(model.parameters(), dense.parameters(), strict=True):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            q.copy_(p)
    model.prepack_weights()
    assert model.uses_small_gemm and model.is_prepacked
    assert (model.lm_head_packed is None) == (not onednn_copy)
    cache = KVCache(cfg.num_hidden_layers, 16, 16, cfg.num_key_value_heads, cfg.head_dim, torch.float32, CPU)
    dense_cache = KVCache(
        cfg.num_hidden_layers, 16, 16, cfg.num_key_value_heads, cfg.head_dim, torch.float32, CPU
    )
    prompts = [list(range(5, 75)), [9, 10, 11]]  # 73 prefill rows: more than MAX_ROWS
    prefill = BatchInputs.build(prompts, [0, 0], [[1, 3, 4, 5, 6], [2]], [True, True], 16)
    torch.testing.assert_close(model(prefill, cache), dense(prefill, dense_cache), rtol=1e-4, atol=1e-4)
    decode = BatchInputs.build([[12], [13]], [70, 3], [[1, 3, 4, 5, 6], [2]], [True, True], 16)
    with_kernel = model(decode, cache)
    torch.testing.assert_close(with_kernel, dense(decode, dense_cache), rtol=1e-4, atol=1e-4)
    if not onednn_copy:
        return
    model.small = None
    for module in model.modules():
        if isinstance(module, Linear):
            module.small = None
    torch.testing.assert_close(model(decode, cache), with_kernel, rtol=1e-4, atol=1e-4)
    assert not build_model(cfg, torch.bfloat16, CPU).uses_small_gemm
