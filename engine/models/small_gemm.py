"""float32 matmuls in C (``csrc/small_gemm.c``) over weights packed in 16-output panels:
``[ceil(N / 16), K, 16]``, zero-padded.

Why: at 16 rows oneDNN's prepacked float32 kernels reach well under the machine's FMA peak and memory
bandwidth (docs/BENCHMARKS.md); streaming one panel per block of 16 rows, with every row's accumulator in
a register, is compute-bound instead. The kernel computes on 8-float (AVX2) vectors: on a CPU whose widest
vectors are those it also beats oneDNN at prefill sizes (2,048 rows: 160 against 144 GFLOPS, at the FMA
peak), so there it takes every batch and the weights are not kept in oneDNN's layout at all
(``takes_every_batch``). With AVX-512, batches of more than ``MAX_ROWS`` rows stay on oneDNN.

Each output is one fused multiply-add chain over ``k`` in order, then the bias.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.native_build import BuildOnce

SOURCE = Path(__file__).with_name("csrc") / "small_gemm.c"
PANEL = 16
MAX_ROWS = 64  # calls of at most this many rows use the kernel (faster than oneDNN up to here: docs/BENCHMARKS.md)


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


def fits(x: torch.Tensor) -> bool:
    """Whether ``x`` goes to the small kernel when oneDNN holds the weights too: 2-D float32 rows,
    contiguous, at most ``MAX_ROWS`` of them."""
    return x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == torch.float32 and x.stride(1) == 1


def takes_every_batch() -> bool:
    """Whether the kernel serves every call, prefill included, and oneDNN's copy of the weights is not
    made: on CPUs without AVX-512, where it is the faster of the two at every row count (``python -m
    bench.cpu_matmul``; docs/BENCHMARKS.md)."""
    return not torch.backends.cpu.get_cpu_capability().startswith("AVX512")


class SmallGemm:
    """``ctypes`` binding; ``pack`` once per weight, ``linear`` per call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._gemm = lib.cbserve_small_gemm
        self._gemm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64]
        self._gemm.restype = None
        if int(lib.cbserve_small_gemm_panel()) != PANEL:
            raise RuntimeError("small_gemm.c and small_gemm.py disagree on the panel width")

    @staticmethod
    def packed_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
        return -(-out_features // PANEL), in_features, PANEL

    @staticmethod
    def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``weight`` ``[N, K]`` float32 -> ``[ceil(N / 16), K, 16]``, into ``out`` (contiguous, of that
        shape: ``packed_shape``) or a new tensor."""
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"expected a 2-D float32 CPU weight, got {weight.dtype} {tuple(weight.shape)}")
        n, k = weight.shape
        shape = SmallGemm.packed_shape(n, k)
        if out is None:
            out = torch.empty(shape, dtype=torch.float32)
        elif out.shape != shape or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float32 tensor of shape {shape}")
        full = n // PANEL  # panels without padding
        out[:full].copy_(weight[: full * PANEL].view(full, PANEL, k).transpose(1, 2))
        if full < shape[0]:
            out[full].zero_()
            out[full, :, : n - full * PANEL].copy_(weight[full * PANEL :].T)
        return out

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        """``linear`` for ``x`` of any shape ``[..., K]`` and any strides (copied to contiguous rows first if
        need be): ``[..., out_features]``."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        return self.linear(rows, packed, out_features, bias).view(*x.shape[:-1], out_features)

    def linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T + b`` for ``x`` ``[M, K]`` float32 (rows contiguous) and ``packed`` from ``pack``."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu":
            raise ValueError(f"expected 2-D float32 CPU rows, got {x.dtype} {tuple(x.shape)} {x.stride()}")
        m, k = x.shape
        if packed.dim() != 3 or packed.shape[1] != k or packed.shape[0] * PANEL < out_features:
            raise ValueError(f"packed weight {tuple(packed.shape)} does not fit x {tuple(x.shape)}")
        if bias is not None and (bias.shape != (out_features,) or not bias.is_contiguous()):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {out_features} outputs")
        out = torch.empty(m, out_features, dtype=torch.float32)
        self._gemm(
            out.data_ptr(), out_features, x.data_ptr(), x.stride(0), packed.data_ptr(),
            None if bias is None else bias.data_ptr(), m, out_features, k,
        )  # fmt: skip
        return out


# Built once per process; raises ``KernelUnavailable`` with the reason when it cannot be.
load = BuildOnce(SOURCE, SmallGemm)
