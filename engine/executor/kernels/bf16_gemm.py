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
from engine.executor.kernels.block_codes import BLOCK, BlockCodes, as_four_bit

SOURCE = Path(__file__).with_name("csrc") / "bf16_gemm.c"
PANEL = 16
# calls of at most this many rows (one register block) read a weight's blocks where it has them: a decode
# step of a few rows is bound by reading the weights; with more, expanding them costs more than the bytes
# save (docs/BENCHMARKS.md)
QUANTIZED_MAX_ROWS = 12


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
        self._qgemm = lib.cbserve_bf16_qgemm
        self._qgemm.argtypes = [ptr, i64, ctypes.c_int, ptr, i64, ptr, ctypes.c_int, ptr, i64, i64, i64]
        self._qgemm.restype = ctypes.c_int
        self._swiglu = lib.cbserve_bf16_gemm_swiglu
        self._swiglu.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, i64]
        self._swiglu.restype = ctypes.c_int
        lib.cbserve_bf16_gemm_qblock_bytes.argtypes = [ctypes.c_int]
        layout = [lib.cbserve_bf16_gemm_qblock_bytes(o) for o in (True, False)]
        if lib.cbserve_bf16_gemm_qmax() != QUANTIZED_MAX_ROWS or layout != [
            qblock_bytes(o) for o in (True, False)
        ]:
            raise RuntimeError("bf16_gemm.c and bf16_gemm.py disagree on the blocks' layout")

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

    @staticmethod
    def pack_blocks(codes: BlockCodes) -> tuple[torch.Tensor, bool] | None:
        """``codes`` of an ``[N, K]`` weight -> (uint8 ``[ceil(N / 16), K / 32, block bytes]``, whether
        4-bit: the layout of csrc/bf16_gemm.c), or None where the kernel cannot give their weights bit for bit:
        ``K`` not a multiple of 32, scales that are not float16 values (a code times one is then not exact in
        float32, and the kernel's one rounding of ``d * code + m`` would not be the loader's two), codes of
        8 bits beside offsets."""
        n, k = codes.shape
        if k % BLOCK or not torch.equal(codes.scales.half().float(), codes.scales):
            return None
        four = as_four_bit(codes)
        if four is None and codes.offsets is not None:
            return None
        panels, kb = -(-n // PANEL), k // BLOCK

        def padded(t: torch.Tensor) -> torch.Tensor:  # [n, ...] -> [panels * 16, ...], zeros past n
            return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, panels * PANEL - n))

        def halves(c: torch.Tensor) -> torch.Tensor:
            """[n, K] codes -> [panels, kb, 16 pairs, 2 halves, 16 lanes]: lane t of half h the code of output
            8 h + t / 2 at k = 2i + t % 2 (csrc/bf16_gemm.c's lane order)"""
            c = padded(c).view(panels, 2, 8, kb, BLOCK // 2, 2)  # [p, half, output, kb, pair, k % 2]
            return c.permute(0, 3, 4, 1, 2, 5).reshape(panels, kb, BLOCK // 2, 2, PANEL)

        def floats(t: torch.Tensor) -> torch.Tensor:  # [n, kb] float32 -> [panels, kb, 64] bytes
            per_output = padded(t.float().view(n, kb)).view(panels, PANEL, kb).transpose(1, 2)
            return per_output.contiguous().view(torch.uint8)

        if four is not None:  # a byte per (pair, lane): the first half's code low, the second's high
            lanes = halves(four[0].to(torch.uint8))
            code_bytes = (lanes[:, :, :, 0] | (lanes[:, :, :, 1] << 4)).reshape(panels, kb, -1)
            parts = [code_bytes, floats(codes.scales), floats(four[1])]
        else:  # per pair, the first half's 16 codes, then the second's
            parts = [halves(codes.codes).reshape(panels, kb, -1).view(torch.uint8), floats(codes.scales)]
        packed = torch.cat(parts, dim=-1).contiguous()
        assert packed.shape[-1] == qblock_bytes(four is not None)
        return packed, four is not None

    def qlinear(
        self,
        x: torch.Tensor,
        qpacked: torch.Tensor,
        four_bit: bool,
        out_features: int,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """``linear`` for at most ``QUANTIZED_MAX_ROWS`` rows over ``pack_blocks``' blocks: the same bits as
        over the bfloat16 panels of the weights they give."""
        rows = _rows(x)
        m, k = rows.shape
        if m > QUANTIZED_MAX_ROWS:
            raise ValueError(f"at most {QUANTIZED_MAX_ROWS} rows read the blocks, got {m}")
        if (
            qpacked.shape[1:] != (k // BLOCK, qblock_bytes(four_bit))
            or qpacked.shape[0] * PANEL < out_features
        ):
            raise ValueError(f"packed blocks {tuple(qpacked.shape)} do not fit x {tuple(x.shape)}")
        out = _output(m, out_features, bias, out_dtype)
        b = None if bias is None else bias.contiguous().data_ptr()
        f32 = int(out_dtype == torch.float32)
        args = (rows.data_ptr(), rows.stride(0), qpacked.data_ptr(), int(four_bit), b, m, out_features, k)
        if m and self._qgemm(out.data_ptr(), out_features, f32, *args):
            raise MemoryError("bfloat16 matmul: out of memory for a scratch block")
        return out.view(*x.shape[:-1], out_features)

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
        rows = _rows(x)
        m, k = rows.shape
        if packed.shape[1:] != (-(-k // 2), PANEL, 2) or packed.shape[0] * PANEL < out_features:
            raise ValueError(f"packed weight {tuple(packed.shape)} does not fit x {tuple(x.shape)}")
        out = _output(m, out_features, bias, out_dtype)
        b = None if bias is None else bias.contiguous().data_ptr()
        f32 = int(out_dtype == torch.float32)
        args = (rows.data_ptr(), rows.stride(0), packed.data_ptr(), b, m, out_features, k)
        if m and self._gemm(out.data_ptr(), out_features, f32, *args):
            raise MemoryError("bfloat16 matmul: out of memory for a scratch block")
        return out.view(*x.shape[:-1], out_features)

    def swiglu(self, x: torch.Tensor, packed: torch.Tensor, inter: int) -> torch.Tensor:
        """SwiGLU's projection and gate in one call: ``silu(g) * u`` for ``[g | u] = x W^T``, ``packed`` a gated
        MLP's fused ``[2 * inter, K]`` gate and up weight from ``pack`` (no bias; ``inter`` a multiple of 16):
        the bits of ``linear`` then ``CpuOps.silu_and_mul``, ``[..., inter]``, without writing ``[g | u]`` out."""
        rows = _rows(x)
        m, k = rows.shape
        if packed.shape[1:] != (-(-k // 2), PANEL, 2) or packed.shape[0] * PANEL != 2 * inter:
            raise ValueError(f"packed weight {tuple(packed.shape)} is not a [2 x {inter}, {k}] gate and up")
        if inter % PANEL:
            raise ValueError(f"SwiGLU over the panels needs inter a multiple of {PANEL}, got {inter}")
        out = torch.empty(m, inter, dtype=torch.bfloat16)
        if m and self._swiglu(
            out.data_ptr(), inter, rows.data_ptr(), rows.stride(0), packed.data_ptr(), m, inter, k
        ):
            raise MemoryError("bfloat16 matmul: out of memory for a scratch block")
        return out.view(*x.shape[:-1], inter)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., K]`` as rows ``[M, K]`` whose elements are contiguous, checked to be bfloat16 on the CPU."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"expected bfloat16 CPU rows, got {x.dtype} on {x.device}")
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _output(m: int, out_features: int, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The ``[m, out_features]`` output of a call, after checking its bias and dtype."""
    if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.bfloat16):
        raise ValueError(f"bias {bias.dtype} {tuple(bias.shape)} for {out_features} bfloat16 outputs")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    return torch.empty(m, out_features, dtype=out_dtype)


def qblock_bytes(four_bit: bool) -> int:
    """Bytes of one (panel, 32-k block) of ``pack_blocks``: 4-bit codes two to a byte with float32 scales
    and offsets, or 8-bit codes with float32 scales."""
    return BLOCK * PANEL // 2 + 2 * PANEL * 4 if four_bit else BLOCK * PANEL + PANEL * 4


# Built once per process; raises ``KernelUnavailable`` with the reason when it cannot be.
load = BuildOnce(SOURCE, Bf16Gemm)
