"""bfloat16 matmuls of up to ``MAX_ROWS`` rows on AMX tiles, reading a weight that the checkpoint stored in
32-weight blocks of codes (``BlockCodes``: a GGUF's Q4_0, Q4_1, Q8_0) in those blocks (``csrc/amx_qgemm.c``).

Why: a decode step reads every weight once for a few rows, so it is bound by memory. SmolLM2-135M's layers
are Q4_1 and its output head Q8_0: 96 MB a step instead of the bfloat16 weights' 270 MB. Each tile is
expanded to bfloat16 in L1 just before the tile unit reads it, to the very bfloat16 weights the model
loaded (engine/executor/fast_paths.py checks), and multiplied in amx_gemm.c's order: the same bits as ``AmxGemm`` over those
weights, so a row's result still does not depend on its batch.

    packed: uint8 [N_pad / 16, K / 32, tile bytes]   (N padded to 64; 4-bit codes with an offset per block:
                                                      320 bytes a tile, two outputs' codes a byte; 8-bit
                                                      codes: 544; the layouts: csrc/amx_qgemm.c)
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.cpu.native_build import BuildOnce, KernelUnavailable
from engine.executor.kernels.amx_gemm import GROUP_N, TILE_K, TILE_N
from engine.executor.kernels.block_codes import BlockCodes, as_four_bit

SOURCE = Path(__file__).with_name("csrc") / "amx_qgemm.c"
MAX_ROWS = 32  # two A tiles: decode steps of up to 32 sequences


def tile_bytes(four_bit: bool) -> int:
    """Bytes of one quantized tile (16 outputs x 32 k): codes, then float16 scales (and offsets)."""
    return TILE_K * TILE_N // 2 + 4 * TILE_N if four_bit else TILE_K * TILE_N + 2 * TILE_N


def _half_exact(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as float16 where every value survives the round trip (a GGUF's are float16 widened), else None."""
    h = t.to(torch.float16)
    return h if torch.equal(h.float(), t) else None


def _sums_exact(scales: torch.Tensor, offsets: torch.Tensor) -> bool:
    """Whether ``m - d * 2^s`` is a float32 for every block, s = 7 and 11: the kernel's constant C of the
    4-bit codes (amx_qgemm.c: ``d * code + m = D * f + C``); true of every block of SmolLM2's Q4_1."""
    d, m = scales.double(), offsets.double()
    return all(torch.equal((m - d * 2**s).float().double(), m - d * 2**s) for s in (7, 11))


def _stored(codes: BlockCodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``codes`` as the tiles store them -- the codes (4-bit: 0..15; 8-bit: code + 128), float16 scales and
    (4-bit) float16 offsets -- or None where the kernel cannot give their weights bit for bit: scales or
    offsets not float16 values, a 4-bit block's C not a float32, offsets beside codes past 4 bits."""
    scales = _half_exact(codes.scales)
    if scales is None or codes.shape[-1] % TILE_K:
        return None
    four = as_four_bit(codes)
    if four is None:  # 8-bit codes, which the tiles keep without offsets
        return None if codes.offsets is not None else (codes.codes.to(torch.int16) + 128, scales, None)
    offsets = _half_exact(four[1])
    if offsets is None or not _sums_exact(codes.scales, four[1]):
        return None
    return four[0], scales, offsets


def pack(codes: BlockCodes) -> tuple[torch.Tensor, bool] | None:
    """``codes`` of an ``[N, K]`` weight -> (packed tiles, whether 4-bit), or None where the kernel cannot
    give its weights bit for bit (``_stored``)."""
    stored = _stored(codes)
    if stored is None:
        return None
    raw, scales, offsets = stored
    n, k = codes.shape
    n_pad = -(-n // GROUP_N) * GROUP_N
    kb = k // TILE_K

    def tiles(t: torch.Tensor) -> torch.Tensor:  # [n, kb, ...] -> [n_pad / 16, kb, 16, ...] per tile
        t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, n_pad - n))
        return t.view(n_pad // TILE_N, TILE_N, kb, *t.shape[2:]).transpose(1, 2)

    def scale_bytes(s: torch.Tensor) -> torch.Tensor:  # [n, kb] float16 -> [tiles, kb, 32] bytes
        return tiles(s.view(n, kb, 1)).reshape(n_pad // TILE_N, kb, TILE_N).contiguous().view(torch.uint8)

    # a tile's outputs in order, each with its block's 32 codes in order of k (an A tile row each)
    rows = tiles(raw.to(torch.uint8).view(n, kb, TILE_K))  # [tiles, kb, 16 outputs, 32 codes]
    if offsets is not None:  # 4-bit: outputs 2i and 2i + 1 share 32 bytes, 2i's code low, 2i + 1's high
        code_bytes = rows[:, :, 0::2] | (rows[:, :, 1::2] << 4)
        parts = [code_bytes.reshape(n_pad // TILE_N, kb, -1), scale_bytes(scales), scale_bytes(offsets)]
    else:
        parts = [rows.reshape(n_pad // TILE_N, kb, -1), scale_bytes(scales)]
    packed = torch.cat(parts, dim=-1).contiguous()
    assert packed.shape[-1] == tile_bytes(offsets is not None)
    return packed, offsets is not None


class AmxQGemm:
    """``ctypes`` binding; ``pack`` once per weight, ``linear`` per call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        if not lib.cbserve_amx_qgemm_available():
            raise KernelUnavailable(
                "no AMX-BF16 tiles and AVX512-BF16 on this CPU (or no tiles for this process)"
            )
        lib.cbserve_amx_qgemm_tile_bytes.argtypes = [ctypes.c_int]
        if lib.cbserve_amx_qgemm_rows() != MAX_ROWS or [
            lib.cbserve_amx_qgemm_tile_bytes(o) for o in (1, 0)
        ] != [tile_bytes(True), tile_bytes(False)]:
            raise RuntimeError("amx_qgemm.c and amx_qgemm.py disagree on the packed layout")
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._gemm = lib.cbserve_amx_qgemm
        self._gemm.argtypes = [ptr, i64, ptr, i64, ptr, ctypes.c_int, ptr, i64, i64, i64, ctypes.c_int]
        self._gemm.restype = ctypes.c_int

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        four_bit: bool,
        out_features: int,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        """``x W^T + b`` for ``x`` ``[..., K]`` bfloat16 of at most ``MAX_ROWS`` rows, ``packed`` from ``pack``;
        ``out_dtype`` float32: the same bfloat16 values widened, written so by the kernel (an output head's
        logits, which the sampler reads as float32, without a second pass)."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        m, k = rows.shape
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or m > MAX_ROWS:
            raise ValueError(
                f"expected at most {MAX_ROWS} bfloat16 CPU rows, got {m} {x.dtype} on {x.device}"
            )
        if packed.shape[1:] != (k // TILE_K, tile_bytes(four_bit)) or packed.shape[0] * TILE_N < out_features:
            raise ValueError(f"packed weight {tuple(packed.shape)} does not fit x {tuple(x.shape)}")
        if bias is not None and (bias.shape != (out_features,) or bias.dtype != torch.bfloat16):
            raise ValueError(f"bias {bias.dtype} {tuple(bias.shape)} for {out_features} bfloat16 outputs")
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the outputs are bfloat16 or float32, not {out_dtype}")
        out = torch.empty(m, out_features, dtype=out_dtype)
        b = None if bias is None else bias.contiguous().data_ptr()
        args = (rows.data_ptr(), rows.stride(0), packed.data_ptr(), int(four_bit), b, m, out_features, k)
        if m and self._gemm(out.data_ptr(), out_features, *args, int(out_dtype == torch.float32)):
            raise MemoryError("AMX matmul: out of memory for a scratch block")
        return out.view(*x.shape[:-1], out_features)


# Built once per process; raises ``KernelUnavailable`` with the reason when it cannot be.
load = BuildOnce(SOURCE, AmxQGemm)
