"""bfloat16 matmuls on AVX512-BF16's dot products in C (``csrc/bf16_gemm.c``), for CPUs that have them but no
AMX tiles (AMD Zen 4 and later), over weights packed once in 16-output panels of k-pairs:
``[ceil(N / 16), ceil(K / 2), 16, 2]``, zero-padded.

Why: a row's result independent of its batch, by default, on those CPUs too, and speed. oneDNN picks its
bfloat16 kernel and blocking by the call's row count, so a decode row computed alone and beside a prefill
chunk would be rounded differently; here every output is one float32 chain of ``VDPBF16PS`` over the k-pairs
in order, then the bias and one rounding to bfloat16, whatever else the call holds. The kernel takes calls
of every size (engine/executor/fast_paths.py) and the bfloat16 decode stack runs whole decode steps over its
panels (engine/executor/decode_stack.py). Measured against oneDNN: docs/BENCHMARKS.md (``python -m
bench.cpu_matmul --dtype bfloat16``).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.cpu.native_build import BuildOnce, KernelUnavailable

SOURCE = Path(__file__).with_name("csrc") / "bf16_gemm.c"
PANEL = 16


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16


class Bf16Gemm:
    """``ctypes`` binding; ``pack`` once per weight, ``linear`` per call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        if not lib.cbserve_bf16_gemm_available():
            raise KernelUnavailable("no AVX512-BF16 dot products on this CPU")
        if lib.cbserve_bf16_gemm_panel() != PANEL:
            raise RuntimeError("bf16_gemm.c and bf16_gemm.py disagree on the panel width")
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._gemm = lib.cbserve_bf16_gemm
        self._gemm.argtypes = [ptr, i64, ctypes.c_int, ptr, i64, ptr, ptr, i64, i64, i64]
        self._gemm.restype = ctypes.c_int

    @staticmethod
    def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int, int]:
        return -(-out_features // PANEL), -(-in_features // 2), PANEL, 2

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[N, K]`` bfloat16 -> ``[ceil(N / 16), ceil(K / 2), 16, 2]``: per 16 outputs, their
        k-pairs (zeros past ``N`` and past an odd ``K``)."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"expected a 2-D bfloat16 CPU weight, got {weight.dtype} {tuple(weight.shape)}")
        n, k = weight.shape
        panels, pairs, _, _ = Bf16Gemm.packed_shape(n, k)
        w = torch.nn.functional.pad(weight.detach(), (0, 2 * pairs - k, 0, panels * PANEL - n))
        return w.view(panels, PANEL, pairs, 2).permute(0, 2, 1, 3).contiguous()

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """``x W^T + b`` for ``x`` ``[..., K]`` bfloat16 and ``packed`` from ``pack``: ``[..., out_features]``,
        rounded to bfloat16 (``out_dtype`` float32: those values widened, written by the kernel)."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        m, k = rows.shape
        if x.dtype != torch.bfloat16 or x.device.type != "cpu":
            raise ValueError(f"expected bfloat16 CPU rows, got {x.dtype} on {x.device}")
        if packed.shape[1:] != (-(-k // 2), PANEL, 2) or packed.shape[0] * PANEL < out_features:
            raise ValueError(f"packed weight {tuple(packed.shape)} does not fit x {tuple(x.shape)}")
        if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.bfloat16):
            raise ValueError(f"bias {bias.dtype} {tuple(bias.shape)} for {out_features} bfloat16 outputs")
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
        out = torch.empty(m, out_features, dtype=out_dtype)
        b = None if bias is None else bias.contiguous().data_ptr()
        f32 = int(out_dtype == torch.float32)
        args = (rows.data_ptr(), rows.stride(0), packed.data_ptr(), b, m, out_features, k)
        if m and self._gemm(out.data_ptr(), out_features, f32, *args):
            raise MemoryError("bfloat16 matmul: out of memory for a scratch block")
        return out.view(*x.shape[:-1], out_features)


# Built once per process; raises ``KernelUnavailable`` with the reason when it cannot be.
load = BuildOnce(SOURCE, Bf16Gemm)
