"""A batch-invariant matmul on CUDA (Triton): a row's result is the same bits whatever else is in
the batch, as "Defeating Nondeterminism in LLM Inference" (Thinking Machines, 2025) and vLLM's
batch-invariant mode build it.

Why: cuBLAS picks its kernel (tile shape, split-K) by the matrix sizes, so the same row of ``x @ W^T``
is reduced in another order in a step of 1 row than in a step of 64; PyTorch's reductions (the norm's
mean of squares) likewise spread one row over more threads when there are few rows. Here:

- ``matmul``: one tile shape for every call (``BLOCK_M x BLOCK_N``, the K axis walked in ``BLOCK_K``
  steps from 0, one accumulator, no split-K): an output element's sum runs in the same order whatever
  ``M`` is, and rows never mix (a padded row adds nothing to another's).
- the norms: ``triton_rms_norm.py``'s kernel, one program per row over the whole row.

Slower than cuBLAS for some shapes (no split-K for skinny decode matmuls): ``--batch-invariant`` only
(docs/GENERATION.md). Triton is imported on first use.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from engine.cpu.native_build import KernelUnavailable
from engine.executor.kernels.triton_rms_norm import use_triton_rms_norms
from engine.executor.models.layers import Linear

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
NUM_WARPS, NUM_STAGES = 4, 3


@functools.cache
def _kernels() -> Any:
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

    return matmul_kernel


def load() -> None:
    """Compile nothing yet; raise ``KernelUnavailable`` when Triton is missing."""
    try:
        _kernels()
    except ImportError as e:
        raise KernelUnavailable(f"Triton is not installed ({e})") from e


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` (``x`` ``[..., K]``, ``weight`` ``[N, K]``), each row reduced in one fixed order."""
    matmul_kernel = _kernels()
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


class InvariantLinear(Linear):
    """A ``Linear`` over the batch-invariant matmul (the same weight and bias parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = matmul(x, self.weight)
        return out if self.bias is None else out + self.bias


def apply_cuda_batch_invariance(model: nn.Module) -> None:
    """Swap every ``Linear`` of ``model`` (on CUDA) for its batch-invariant twin, in place (sharing its
    parameters: nothing is copied), and every ``RMSNorm`` for the one-program-a-row kernel
    (``triton_rms_norm.py``, the CUDA default already). ``KernelUnavailable`` without Triton."""
    load()
    use_triton_rms_norms(model)
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = InvariantLinear
