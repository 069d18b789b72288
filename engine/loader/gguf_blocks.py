"""The GGUF block quantizations the default model uses (Q4_0, Q4_1, Q8_0), dequantized with torch.

gguf-py's numpy dequantizers were a third of loading the default model (measured: docs/benchmarks-log.md,
commit d7cd103); these run the same arithmetic as vectorised, multi-threaded torch ops and give bit-for-bit
the same floats (tests/model/test_gguf_blocks.py checks them against gguf-py). Other
types go to gguf-py (``decode`` returns None for them).

Each block holds 32 weights after a float16 scale ``d`` (and, for Q4_1, a float16 minimum ``m``);
``split`` gives the codes ``q`` with ``d`` and ``m`` (engine/executor/kernels/block_codes.py), ``decode`` the weights:

    Q8_0  [d][32 x int8]                 w = d * q
    Q4_0  [d][16 bytes: two nibbles each] w = d * (q - 8)
    Q4_1  [d][m][16 bytes]               w = d * q + m

A byte's low nibble is weight ``i`` of the block, its high nibble weight ``i + 16``.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.executor.kernels.block_codes import BLOCK, BlockCodes

_TYPES = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
_BYTES = {qtype: GGML_QUANT_SIZES[qtype][1] for qtype in _TYPES}  # bytes per block: 34, 18, 20
assert all(GGML_QUANT_SIZES[qtype][0] == BLOCK for qtype in _TYPES)


def supports(qtype: GGMLQuantizationType) -> bool:
    return qtype in _BYTES


def _f16(column: torch.Tensor) -> torch.Tensor:
    """Two bytes per block ``[num_blocks, 2]`` read as one float16, widened: ``[num_blocks, 1]`` float32."""
    return column.contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, 16]`` bytes -> ``[num_blocks, 32]`` values 0..15: low nibbles, then high nibbles."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1)


def split(data: np.ndarray, qtype: GGMLQuantizationType) -> BlockCodes | None:
    """``data`` (uint8, ``[..., row_bytes]``, as gguf-py's reader holds a quantized tensor) as its codes,
    scales and offsets (``[..., row_bytes / block_bytes * 32]`` weights); None when ``qtype`` is not one of
    this module's."""
    if qtype not in _BYTES:
        return None
    raw = np.ascontiguousarray(data, dtype=np.uint8)
    if raw.shape[-1] % _BYTES[qtype]:
        raise ValueError(f"a {qtype.name} row of {raw.shape[-1]} bytes is not a whole number of blocks")
    rows, blocks_per_row = raw.shape[:-1], raw.shape[-1] // _BYTES[qtype]
    # NOTE: a copy: the reader's memory map is read-only, and torch wants writable memory.
    blocks = torch.from_numpy(raw.copy()).view(-1, _BYTES[qtype])  # [num_blocks, block_bytes]
    d = _f16(blocks[:, 0:2])  # [num_blocks, 1]
    offsets = None
    if qtype == GGMLQuantizationType.Q8_0:
        codes = blocks[:, 2:].contiguous().view(torch.int8)
    elif qtype == GGMLQuantizationType.Q4_0:
        codes = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    else:  # Q4_1
        codes = _nibbles(blocks[:, 4:]).to(torch.int8)
        offsets = _f16(blocks[:, 2:4]).view(*rows, blocks_per_row)
    return BlockCodes(codes.reshape(*rows, blocks_per_row * BLOCK), d.view(*rows, blocks_per_row), offsets)


def decode(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor | None:
    """``data`` (uint8, ``[..., row_bytes]``, as gguf-py's reader holds a quantized tensor) as float32
    ``[..., row_bytes / block_bytes * 32]``; None when ``qtype`` is not one of this module's."""
    codes = split(data, qtype)
    return None if codes is None else codes.dequantize()
