"""float32 matmuls in C (``csrc/small_gemm.c``) over weights packed in 16-output panels:
``[ceil(N / 16), K, 16]``, zero-padded.

Why: at 16 rows oneDNN's prepacked float32 kernels reach well under the machine's FMA peak and memory
bandwidth (docs/BENCHMARKS.md); streaming one panel per block of 16 rows, with every row's accumulator in
a register, is compute-bound instead. The kernel computes on 8-float (AVX2) vectors; with AVX-512, calls of
12 rows or more run on 16-float vectors (two panels x 12 rows of chains in registers, the rows packed
k-major): the same bits. Up to ``MAX_ROWS`` rows (a decode step's output head: 16 rows 12.4 -> 8.0 ms) the
threads share out the panels, past it they split the rows. It takes every call of a float32 model, prefill
included (engine/executor/fast_paths.py), and oneDNN's copy of the weights is not made: at prefill sizes it
is as fast as oneDNN's (``python -m bench.cpu_matmul --dtype float32``: 1.01-1.03x at 128 to 2,048 rows on
Sapphire Rapids; faster on an AVX2-only CPU), and a row's result is one chain per output whatever else the
call holds (batch invariance).

Each output is one fused multiply-add chain over ``k`` in order, then the bias.

Weights that come in 32-weight blocks of integer codes with a scale (and an offset) each -- a GGUF's Q4_0,
Q4_1 and Q8_0 tensors, ``BlockCodes`` -- can be packed as such (``pack_blocks``): a call expands the weights
to float32 just before using them, so the result is bit for bit that of the float32 panels (the loader's
dequantized weights) from 1.1-1.25 bytes a weight instead of 4. That pays where a call is bound by reading
the weights (a few rows: ``QUANTIZED_MAX_ROWS``), not where it is bound by the multiply-adds.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.cpu.native_build import BuildOnce
from engine.executor.kernels.block_codes import BLOCK, BlockCodes

SOURCE = Path(__file__).with_name("csrc") / "small_gemm.c"
PANEL = 16
MAX_ROWS = 64  # calls of at most this many rows share out the panels over the threads, more split the rows
# calls of at most this many rows use a weight's quantized panels where it has them: one register block of
# rows, each weight expanded in registers; more rows pay more for expanding than the bytes save (docs/MODEL.md)
QUANTIZED_MAX_ROWS = 6


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


def fits_quantized(x: torch.Tensor) -> bool:
    """Whether ``x`` goes to a weight's quantized panels: 2-D float32 rows, contiguous, at most
    ``QUANTIZED_MAX_ROWS`` of them."""
    return x.dim() == 2 and x.shape[0] <= QUANTIZED_MAX_ROWS and x.dtype == torch.float32 and x.stride(1) == 1


class SmallGemm:
    """``ctypes`` binding; ``pack`` once per weight, ``linear`` per call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._gemm = lib.cbserve_small_gemm
        self._gemm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64]
        self._gemm.restype = None
        self._qgemm = lib.cbserve_small_gemm_q
        self._qgemm.argtypes = [ptr, i64, ptr, i64, ptr, ctypes.c_int, ptr, i64, i64, i64]
        self._qgemm.restype = ctypes.c_int
        if int(lib.cbserve_small_gemm_panel()) != PANEL:
            raise RuntimeError("small_gemm.c and small_gemm.py disagree on the panel width")
        if (
            int(lib.cbserve_small_gemm_rows()) != QUANTIZED_MAX_ROWS
        ):  # the rows whose weights stay in registers
            raise RuntimeError("small_gemm.c's register block and QUANTIZED_MAX_ROWS disagree")
        lib.cbserve_small_gemm_qblock_bytes.argtypes = [ctypes.c_int]
        lib.cbserve_small_gemm_qblock_bytes.restype = i64
        if [lib.cbserve_small_gemm_qblock_bytes(o) for o in (0, 1)] != [
            qblock_bytes(False),
            qblock_bytes(True),
        ]:
            raise RuntimeError("small_gemm.c and small_gemm.py disagree on the quantized block layout")

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

    @staticmethod
    def qpacked_shape(out_features: int, in_features: int, offsets: bool) -> tuple[int, int, int]:
        return -(-out_features // PANEL), in_features // BLOCK, qblock_bytes(offsets)

    @staticmethod
    def pack_blocks(codes: BlockCodes, out: torch.Tensor | None = None) -> torch.Tensor:
        """``codes`` of a ``[N, K]`` weight -> uint8 ``[ceil(N / 16), K / 32, block bytes]`` (the layout of
        small_gemm.c), into ``out`` (contiguous, of that shape: ``qpacked_shape``) or a new tensor."""
        n, k = codes.codes.shape
        offsets = codes.offsets is not None
        shape = SmallGemm.qpacked_shape(n, k, offsets)
        if out is None:
            out = torch.empty(shape, dtype=torch.uint8)
        elif out.shape != shape or out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous uint8 tensor of shape {shape}")
        panels, blocks = shape[0], shape[1]
        pad = panels * PANEL - n  # padded outputs: codes, scales and offsets 0 (weights 0, results dropped)

        def panel_major(t: torch.Tensor, width: int) -> torch.Tensor:
            """[N, blocks * width] -> [panels, blocks, width * 16]: per block, width k-rows of 16 outputs"""
            t = torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t
            return (
                t.view(panels, PANEL, blocks, width).permute(0, 2, 3, 1).contiguous().view(panels, blocks, -1)
            )

        code_bytes = BLOCK * PANEL
        out[..., :code_bytes].copy_(panel_major(codes.codes, BLOCK).view(torch.uint8))
        out[..., code_bytes : code_bytes + 4 * PANEL].copy_(panel_major(codes.scales, 1).view(torch.uint8))
        if codes.offsets is not None:
            out[..., code_bytes + 4 * PANEL :].copy_(panel_major(codes.offsets, 1).view(torch.uint8))
        return out

    def matmul(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``linear`` for ``x`` of any shape ``[..., K]`` and any strides (copied to contiguous rows first if
        need be): ``[..., out_features]``."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        return self.linear(rows, packed, out_features, bias).view(*x.shape[:-1], out_features)

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x W^T + b`` for ``x`` ``[M, K]`` float32 (rows contiguous) and ``packed`` from ``pack`` or
        ``pack_blocks``."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu":
            raise ValueError(f"expected 2-D float32 CPU rows, got {x.dtype} {tuple(x.shape)} {x.stride()}")
        m, k = x.shape
        quantized = packed.dtype == torch.uint8
        offsets = quantized and packed.dim() == 3 and has_offsets(packed)
        expected = SmallGemm.qpacked_shape(out_features, k, offsets) if quantized else None
        fits = packed.shape == expected and k % BLOCK == 0 if quantized else packed.shape[1:] == (k, PANEL)
        if packed.dim() != 3 or not fits or packed.shape[0] * PANEL < out_features:
            raise ValueError(f"packed weight {tuple(packed.shape)} does not fit x {tuple(x.shape)}")
        if bias is not None and (bias.shape != (out_features,) or not bias.is_contiguous()):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {out_features} outputs")
        out = torch.empty(m, out_features, dtype=torch.float32)
        b = None if bias is None else bias.data_ptr()
        if not quantized:
            self._gemm(
                out.data_ptr(),
                out_features,
                x.data_ptr(),
                x.stride(0),
                packed.data_ptr(),
                b,
                m,
                out_features,
                k,
            )
        elif self._qgemm(
            out.data_ptr(), out_features, x.data_ptr(), x.stride(0), packed.data_ptr(), int(offsets), b, m,
            out_features, k,
        ):  # fmt: skip
            raise MemoryError("small-batch matmul: out of memory for a scratch panel")
        return out


def has_offsets(qpacked: torch.Tensor) -> bool:
    """Whether quantized panels (``pack_blocks``) hold offsets: weights ``d * q + m`` rather than ``d * q``."""
    return qpacked.shape[-1] == qblock_bytes(True)


def qblock_bytes(offsets: bool) -> int:
    """Bytes of one (panel, 32-k block) of quantized panels: 32 x 16 int8 codes, 16 float32 scales and,
    with offsets, 16 float32 offsets."""
    return BLOCK * PANEL + (2 if offsets else 1) * PANEL * 4


# Built once per process; raises ``KernelUnavailable`` with the reason when it cannot be.
load = BuildOnce(SOURCE, SmallGemm)
