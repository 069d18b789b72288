"""The rotary embedding and SwiGLU's gate on CUDA, one Triton kernel each, with PyTorch's arithmetic
(``RotaryEmbedding.rotate`` and ``SiluAndMul`` in engine/executor/models/layers.py).

Why: in PyTorch a rotation is three kernels (roll, multiply, addcmul) and the gate two (silu, multiply),
each a pass over the activations and a launch. In a decode step of a few dozen rows those passes are tiny
and the launches are what costs: on an H200 they were ~0.5 ms of Llama-3-8B's 8 ms step at 64 sequences
(docs/BENCHMARKS.md). Each element is computed alone, so both stay batch-invariant.

Native models on CUDA take them when Triton imports (engine/loader/model_loader.py); Triton is imported on
first use.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from engine.cpu.native_build import KernelUnavailable
from engine.executor.models.layers import RotaryEmbedding, SiluAndMul

GATE_BLOCK = 1024  # gate elements a program


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def rotate_kernel(
        x_ptr,  # [num_tokens, heads, head_dim], the last axis contiguous
        cos_ptr,  # [num_tokens, head_dim] (a row a token)
        sin_ptr,  # [num_tokens, head_dim]: the sin with rotate_half's sign folded in
        out_ptr,  # [num_tokens, heads, head_dim] contiguous
        stride_xt,
        stride_xh,
        stride_ct,
        stride_st,
        heads,
        HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        token = tl.program_id(0)
        h = tl.arange(0, HEADS)[:, None]
        d = tl.arange(0, HEAD_DIM)[None, :]
        ok = h < heads
        row = x_ptr + token * stride_xt + h * stride_xh
        x = tl.load(row + d, mask=ok, other=0.0).to(tl.float32)
        rolled = tl.load(row + (d + HEAD_DIM // 2) % HEAD_DIM, mask=ok, other=0.0).to(tl.float32)
        cos = tl.load(cos_ptr + token * stride_ct + d).to(tl.float32)
        sin = tl.load(sin_ptr + token * stride_st + d).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        x_cos = (
            (x * cos).to(dtype).to(tl.float32)
        )  # as torch.addcmul(x * cos, ...): the product rounded first
        out = x_cos + rolled * sin
        tl.store(out_ptr + (token * heads + h) * HEAD_DIM + d, out.to(dtype), mask=ok)

    @triton.jit
    def silu_and_mul_kernel(
        gate_up_ptr,  # [num_tokens, 2 * inter], the last axis contiguous
        out_ptr,  # [num_tokens, inter] contiguous
        stride_t,
        inter,
        BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        gate = tl.load(gate_up_ptr + token * stride_t + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + token * stride_t + inter + cols, mask=ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # as F.silu(gate) * up: rounded first
        tl.store(out_ptr + token * inter + cols, (silu * up).to(dtype), mask=ok)

    return rotate_kernel, silu_and_mul_kernel


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``x * cos + roll(x, head_dim / 2) * sin_signed`` for ``x`` ``[num_tokens, heads, head_dim]`` and
    ``cos`` / ``sin_signed`` ``[num_tokens, 1, head_dim]``: a new contiguous tensor."""
    num_tokens, heads, head_dim = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    cos, sin_signed = cos.reshape(num_tokens, head_dim), sin_signed.reshape(num_tokens, head_dim)
    out = torch.empty((num_tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if num_tokens:
        _kernels()[0][(num_tokens,)](
            x,
            cos,
            sin_signed,
            out,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            sin_signed.stride(0),
            heads,
            HEADS=1 << max(heads - 1, 0).bit_length(),
            HEAD_DIM=head_dim,
        )
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[num_tokens, 2 * inter]`` (gate first): ``[num_tokens, inter]``."""
    num_tokens, width = gate_up.shape
    inter = width // 2
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        grid = (num_tokens, -(-inter // GATE_BLOCK))
        _kernels()[1][grid](gate_up, out, gate_up.stride(0), inter, BLOCK=GATE_BLOCK)
    return out


class TritonRotaryEmbedding(RotaryEmbedding):
    """A ``RotaryEmbedding`` (the same tables) whose rotation is one kernel."""

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        if not _power_of_two(self.head_dim):
            return super().rotate(x, cos, sin_signed)
        return rotate(x, cos, sin_signed)


class TritonSiluAndMul(SiluAndMul):
    """``SiluAndMul`` in one kernel."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def use_triton_elementwise(model: nn.Module) -> None:
    """Every ``RotaryEmbedding`` and ``SiluAndMul`` of ``model`` (on CUDA) takes its kernel, in place.
    ``KernelUnavailable`` when Triton does not import."""
    try:
        _kernels()
    except ImportError as e:
        raise KernelUnavailable(f"Triton is not installed ({e})") from e
    swaps = {RotaryEmbedding: TritonRotaryEmbedding, SiluAndMul: TritonSiluAndMul}
    for module in model.modules():
        if type(module) in swaps:
            module.__class__ = swaps[type(module)]
