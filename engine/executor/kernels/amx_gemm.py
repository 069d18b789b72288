"""bfloat16 matmuls on Intel AMX tiles in C (``csrc/amx_gemm.c``) over weights packed once into the tiles'
layout: ``[N_pad / 16, K / 32, 16, 16, 2]`` (k-pairs of 16 outputs per 1 KB tile; N padded to 64).

Why: speed, and a row's result independent of its batch (docs/GENERATION.md, "Batch invariance"). The kernel
is faster than oneDNN's up to ~1,300 rows and as fast from there on (``python -m bench.cpu_matmul --dtype
bfloat16``, docs/BENCHMARKS.md), and the bfloat16 decode stack runs whole decode steps over its tiles
(engine/executor/decode_stack.py). oneDNN picks its bfloat16 kernel and blocking by the call's row count, so
a decode row computed alone and the same row beside a prefill chunk would be rounded differently (up to 0.1
in a logprob on Sapphire Rapids); here every output is one chain of tile products over ``k`` in order,
whatever the rows around it. So on CPUs with AMX-BF16 (every ``K`` a multiple of 32) every bfloat16
``Linear`` holds its tiles alone (engine/executor/fast_paths.py), and they take calls of every size.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.cpu.native_build import BuildOnce, KernelUnavailable

SOURCE = Path(__file__).with_name("csrc") / "amx_gemm.c"
TILE_N = 16
TILE_K = 32
GROUP_N = 64


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16


def fits(in_features: int) -> bool:
    """Whether a weight with ``in_features`` columns can be packed (whole 32-k tiles)."""
    return in_features % TILE_K == 0


class AmxGemm:
    """``ctypes`` binding; ``pack`` once per weight, ``linear`` per call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        if not lib.cbserve_amx_gemm_available():
            raise KernelUnavailable(
                "no AMX-BF16 tiles on this CPU (or the kernel lends them not to this process)"
            )
        if (lib.cbserve_amx_gemm_group_n(), lib.cbserve_amx_gemm_tile_k()) != (GROUP_N, TILE_K):
            raise RuntimeError("amx_gemm.c and amx_gemm.py disagree on the packed layout")
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._gemm = lib.cbserve_amx_gemm
        self._gemm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64]
        self._gemm.restype = ctypes.c_int
        # NOTE: None in a library built from an older amx_gemm.c (bench/kernel_ab.py binds those too)
        self._swiglu = getattr(lib, "cbserve_amx_gemm_swiglu", None)
        if self._swiglu is not None:
            self._swiglu.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64]
            self._swiglu.restype = ctypes.c_int

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[N, K]`` bfloat16 -> ``[ceil(N / 64) * 4, K / 32, 16, 16, 2]``: per 16 outputs and 32
        k, a tile of 16 rows of k-pairs (zero rows past ``N``)."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"expected a 2-D bfloat16 CPU weight, got {weight.dtype} {tuple(weight.shape)}")
        n, k = weight.shape
        if not fits(k):
            raise ValueError(f"in_features {k} is not a multiple of {TILE_K}")
        n_pad = -(-n // GROUP_N) * GROUP_N
        w = torch.nn.functional.pad(weight.detach(), (0, 0, 0, n_pad - n))  # [n_pad, K]
        tiles = w.view(n_pad // TILE_N, TILE_N, k // TILE_K, TILE_K // 2, 2)  # [nt, out, kb, pair, 2]
        return tiles.permute(0, 2, 3, 1, 4).contiguous()  # [nt, kb, pair, out, 2]

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x W^T + b`` for ``x`` ``[..., K]`` bfloat16 and ``packed`` from ``pack``: ``[..., out_features]``."""
        rows = _checked_rows(x, packed, out_features)
        m, k = rows.shape
        if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.bfloat16):
            raise ValueError(f"bias {bias.dtype} {tuple(bias.shape)} for {out_features} bfloat16 outputs")
        out = torch.empty(m, out_features, dtype=torch.bfloat16)
        b = None if bias is None else bias.contiguous().data_ptr()
        if m and self._gemm(
            out.data_ptr(),
            out_features,
            rows.data_ptr(),
            rows.stride(0),
            packed.data_ptr(),
            b,
            m,
            out_features,
            k,
        ):
            raise MemoryError("AMX matmul: out of memory for a scratch block")
        return out.view(*x.shape[:-1], out_features)

    @property
    def has_swiglu(self) -> bool:
        return self._swiglu is not None

    def swiglu(self, x: torch.Tensor, packed: torch.Tensor, inter: int) -> torch.Tensor:
        """SwiGLU's projection and gate in one call: ``silu(g) * u`` for ``[g | u] = x W^T``, ``packed`` a gated
        MLP's fused ``[2 * inter, K]`` gate and up weight (no bias; ``inter`` a multiple of 16): the bits of
        ``linear`` then ``CpuOps.silu_and_mul``, ``[..., inter]``, without writing ``[g | u]`` out."""
        rows = _checked_rows(x, packed, 2 * inter)
        m, k = rows.shape
        if self._swiglu is None:
            raise KernelUnavailable(f"{self.path.name} has no SwiGLU call (built from an older source)")
        out = torch.empty(m, inter, dtype=torch.bfloat16)
        rc = self._swiglu(
            out.data_ptr(), inter, rows.data_ptr(), rows.stride(0), packed.data_ptr(), m, inter, k
        )
        if rc == -2:
            raise ValueError(f"SwiGLU over the tiles needs inter a multiple of {TILE_N}, got {inter}")
        if rc:
            raise MemoryError("AMX matmul: out of memory for a scratch block")
        return out.view(*x.shape[:-1], inter)


def _checked_rows(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x`` ``[..., K]`` as rows ``[M, K]`` whose elements are contiguous, checked to be bfloat16 on the CPU
    and to fit ``packed`` (from ``AmxGemm.pack``) of at least ``out_features`` outputs."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    k = rows.shape[1]
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"expected bfloat16 CPU rows, got {x.dtype} on {x.device}")
    if packed.shape[1:] != (k // TILE_K, TILE_K // 2, TILE_N, 2) or packed.shape[0] * TILE_N < out_features:
        raise ValueError(f"packed weight {tuple(packed.shape)} does not fit x {tuple(x.shape)}")
    return rows


# Built once per process; raises ``KernelUnavailable`` with the reason when it cannot be.
load = BuildOnce(SOURCE, AmxGemm)
