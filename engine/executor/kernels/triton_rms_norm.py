"""RMSNorm on CUDA in one Triton kernel: one program a row reads the row once, normalises it in float32,
rounds it to the model's dtype and scales it, as ``RMSNorm`` does (engine/executor/models/layers.py); with
a float32 weight (Gemma's), scales it in float32 and rounds once, as ``RMSNorm`` does then.

Why: PyTorch's path for ``RMSNorm.forward`` is five kernels (the float32 copy, the norm's reduction and
scaling, the cast back, the weight's product), each a pass over the activations; a decode step runs 65 of
them in Llama-3-8B. On an H200 this kernel took a 64-sequence decode step from 9.55 to 8.94 ms
(docs/BENCHMARKS.md). One program a row also makes the norm batch-invariant: a row is reduced in the same
order whatever else the call holds (PyTorch spreads a row over more threads when rows are few).

Native models on CUDA take it when Triton imports (engine/loader/model_loader.py); Triton is imported on
first use.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from engine.cpu.native_build import KernelUnavailable
from engine.executor.models.layers import RMSNorm


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(
        x_ptr, w_ptr, out_ptr, stride_x, stride_o, N, eps, BLOCK: tl.constexpr, SCALE_IN_FLOAT32: tl.constexpr
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        normed = x * rstd
        if not SCALE_IN_FLOAT32:  # as RMSNorm with a weight in the model's dtype: rounded, then scaled
            normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        out = (w * normed).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + cols, out, mask=ok)

    return rms_norm_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm``'s arithmetic over the last axis of ``x``, one program a row (``weight`` in ``x``'s dtype,
    or float32: scaled before the rounding)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = 1 << max(n - 1, 0).bit_length()
        args = (x2, weight, out, x2.stride(0), out.stride(0), n, eps)
        _kernel()[(x2.shape[0],)](*args, BLOCK=block, SCALE_IN_FLOAT32=weight.dtype == torch.float32)
    return out.reshape(x.shape)


class TritonRMSNorm(RMSNorm):
    """An ``RMSNorm`` (the same weight) over the one-program-a-row kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def use_triton_rms_norms(model: nn.Module) -> None:
    """Every ``RMSNorm`` of ``model`` (on CUDA) becomes a ``TritonRMSNorm``, in place.
    ``KernelUnavailable`` when Triton does not import."""
    try:
        _kernel()
    except ImportError as e:
        raise KernelUnavailable(f"Triton is not installed ({e})") from e
    for module in model.modules():
        if type(module) is RMSNorm:
            module.__class__ = TritonRMSNorm
