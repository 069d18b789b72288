"""Batch-invariant matmul and RMSNorm on CUDA (Triton): a row's result is the same bits whatever else is in
the batch, as "Defeating Nondeterminism in LLM Inference" (Thinking Machines, 2025) and vLLM's
batch-invariant mode build it.

Why: cuBLAS picks its kernel (tile shape, split-K) by the matrix sizes, so the same row of ``x @ W^T``
is reduced in another order in a step of 1 row than in a step of 64; PyTorch's reductions (the norm's
mean of squares) likewise spread one row over more threads when there are few rows. Here:

- ``matmul``: one tile shape for every call (``BLOCK_M x BLOCK_N``, the K axis walked in ``BLOCK_K``
  steps from 0, one accumulator, no split-K): an output element's sum runs in the same order whatever
  ``M`` is, and rows never mix (a padded row adds nothing to another's).
- ``rms_norm``: one program per row over the whole row.

Slower than cuBLAS for some shapes (no split-K for skinny decode matmuls): ``--batch-invariant`` only
(docs/GENERATION.md). Triton is imported on first use.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from engine.cpu.native_build import KernelUnavailable
from engine.executor.models.layers import Linear, RMSNorm

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 3


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def matmul_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K]
        out_ptr,  # [M, N]
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            x = tl.load(
                x_ptr + rows[:, None] * stride_xm + k[None, :],
                mask=(rows[:, None] < M) & (k[None, :] < K),
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            w = tl.load(
                w_ptr + cols[None, :] * stride_wn + k[:, None],
                mask=(cols[None, :] < N) & (k[:, None] < K),
                other=0.0,
            )  # [BLOCK_K, BLOCK_N]
            if IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(
            out_ptr + rows[:, None] * stride_om + cols[None, :],
            out,
            mask=(rows[:, None] < M) & (cols[None, :] < N),
        )

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, N, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        normed = (x * rstd).to(out_ptr.dtype.element_ty)  # as RMSNorm: rounded, then scaled
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_o + cols, out, mask=ok)

    return matmul_kernel, rms_norm_kernel


def load() -> None:
    """Compile nothing yet; raise ``KernelUnavailable`` when Triton is missing."""
    try:
        _kernels()
    except ImportError as e:
        raise KernelUnavailable(f"Triton is not installed ({e})") from e


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` (``x`` ``[..., K]``, ``weight`` ``[N, K]``), each row reduced in one fixed order."""
    matmul_kernel, _ = _kernels()
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m, n = x2.shape[0], w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        grid = (-(-m // BLOCK_M), -(-n // BLOCK_N))
        matmul_kernel[grid](
            x2, w, out, m, n, k, x2.stride(0), w.stride(0), out.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )  # fmt: skip
    return out.reshape(*lead, n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm``'s arithmetic, one program per row."""
    _, rms_norm_kernel = _kernels()
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = 1 << max(n - 1, 0).bit_length()
        rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), n, eps, BLOCK=block)
    return out.reshape(x.shape)


class InvariantLinear(Linear):
    """A ``Linear`` over the batch-invariant matmul (the same weight and bias parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = matmul(x, self.weight)
        return out if self.bias is None else out + self.bias


class InvariantRMSNorm(RMSNorm):
    """An ``RMSNorm`` over the one-program-per-row kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def apply_cuda_batch_invariance(model: nn.Module) -> None:
    """Swap every ``Linear`` and ``RMSNorm`` of ``model`` (on CUDA) for its batch-invariant twin, in place:
    the twins share the parameters, so nothing is copied. ``KernelUnavailable`` without Triton."""
    load()
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = InvariantLinear
        elif type(module) is RMSNorm:
            module.__class__ = InvariantRMSNorm
