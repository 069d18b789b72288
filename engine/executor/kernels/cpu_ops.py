"""Fused element-wise ops of the decoder layer on the CPU (``csrc/cpu_ops.c``): RMSNorm with the residual
add, SiLU-and-multiply (GELU-tanh-and-multiply for Gemma), and rotary embedding in place.

Why: a decode step of a small model on a few cores spends as much time in the element-wise steps as in
the matmuls -- each is five to eight torch calls, each call a dispatch and a temporary. Fused, a layer's
element-wise work is three calls. Measured on the benchmark machine in docs/BENCHMARKS.md.

``load()`` returns the ops or raises ``KernelUnavailable`` (no compiler, a failed build); the model uses
them only on the CPU in float32 or bfloat16 (``supports``), and the PyTorch path in
engine/executor/models/layers.py otherwise. Their results equal that path's up to float32 summation order.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import torch

from engine.cpu.native_build import BuildOnce

SOURCE = Path(__file__).with_name("csrc") / "cpu_ops.c"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def _rows_of(x: torch.Tensor) -> tuple[int, int, int]:
    """(rows, cols, row stride) of a 2-D view whose rows are contiguous."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"expected a 2-D tensor with contiguous rows, got shape {tuple(x.shape)}")
    return x.shape[0], x.shape[1], x.stride(0)


class CpuOps:
    """``ctypes`` bindings of the three ops; every call checks devices, dtypes and strides first."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        self._rms_norm = lib.cbserve_rms_norm
        self._rms_norm.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, i64, f32, i32, i32]
        self._rms_norm.restype = None
        self._silu_and_mul = lib.cbserve_silu_and_mul
        self._silu_and_mul.argtypes = [ptr, ptr, i64, i64, i64, i32]
        self._silu_and_mul.restype = None
        self._gelu_tanh_and_mul = lib.cbserve_gelu_tanh_and_mul
        self._gelu_tanh_and_mul.argtypes = [ptr, ptr, i64, i64, i64, i32]
        self._gelu_tanh_and_mul.restype = None
        self._rotary = lib.cbserve_rotary
        self._rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, i32]
        self._rotary.restype = None

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype in SUPPORTED_DTYPES

    @staticmethod
    def _check(*tensors: torch.Tensor) -> int:
        dtype = tensors[0].dtype
        for t in tensors:
            if t.device.type != "cpu" or t.dtype != dtype:
                raise ValueError(f"CPU ops need CPU tensors of one dtype, got {t.dtype} on {t.device}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"CPU ops support float32 and bfloat16, not {dtype}")
        return int(dtype == torch.bfloat16)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """RMSNorm of ``x`` ``[rows, hidden]``; with ``residual``, first ``residual += x`` (in place) and
        the norm of the new ``residual``. ``weight`` in ``x``'s dtype, or float32 (Gemma's: bfloat16 rows
        are then scaled in float32 and rounded once, as ``RMSNorm`` does)."""
        bf16 = self._check(x, *(() if residual is None else (residual,)))
        f32_weight = weight.dtype == torch.float32
        if not f32_weight:
            self._check(x, weight)
        rows, cols, x_stride = _rows_of(x)
        if weight.device.type != "cpu" or weight.shape != (cols,) or not weight.is_contiguous():
            raise ValueError(f"weight of shape {tuple(weight.shape)} on {weight.device} for rows of {cols}")
        if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
            raise ValueError("the residual must be a contiguous tensor of x's shape")
        out = torch.empty(rows, cols, dtype=x.dtype)
        res_ptr = None if residual is None else residual.data_ptr()
        args = (out.data_ptr(), cols, res_ptr, x.data_ptr(), x_stride, weight.data_ptr(), rows, cols, eps)
        self._rms_norm(*args, bf16, int(f32_weight))
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` ``[rows, 2 * inter]`` (gate first) -> ``[rows, inter]``."""
        return self._gated(self._silu_and_mul, gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` (Gemma's MLP), as ``silu_and_mul``."""
        return self._gated(self._gelu_tanh_and_mul, gate_up)

    def _gated(self, fn: Any, gate_up: torch.Tensor) -> torch.Tensor:
        bf16 = self._check(gate_up)
        rows, cols, stride = _rows_of(gate_up)
        if cols % 2:
            raise ValueError(f"gate_up needs an even number of columns, got {cols}")
        out = torch.empty(rows, cols // 2, dtype=gate_up.dtype)
        fn(out.data_ptr(), gate_up.data_ptr(), stride, rows, cols // 2, bf16)
        return out

    def rotary(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
    ) -> None:
        """Rotate ``x`` ``[tokens, heads, head_dim]`` (heads contiguous) in place by the table rows
        ``positions`` of ``cos`` and ``sin_signed`` ``[max_positions, head_dim]``. The caller guarantees
        ``0 <= positions < max_positions`` (checked once per forward, not per layer)."""
        bf16 = self._check(x, cos, sin_signed)
        tokens, heads, head_dim = x.shape
        if x.stride(2) != 1 or x.stride(1) != head_dim or head_dim % 2:
            raise ValueError(f"rotary needs contiguous heads of an even head_dim, got strides {x.stride()}")
        if not (cos.is_contiguous() and sin_signed.is_contiguous() and cos.shape[1] == head_dim):
            raise ValueError("rotary needs contiguous [max_positions, head_dim] tables")
        if positions.dtype != torch.int64 or not positions.is_contiguous() or positions.shape != (tokens,):
            raise ValueError("positions must be a contiguous int64 tensor, one per token")
        self._rotary(
            x.data_ptr(), x.stride(0), tokens, heads, head_dim, positions.data_ptr(), cos.data_ptr(),
            sin_signed.data_ptr(), bf16,
        )  # fmt: skip


# The ops, built once per process; raises ``KernelUnavailable`` with the reason when they cannot be.
load = BuildOnce(SOURCE, CpuOps)
