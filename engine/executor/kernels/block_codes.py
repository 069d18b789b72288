"""Block-quantized weights as they are stored: integer codes with a scale (and an offset) per 32 weights
of a row, as in a GGUF's Q4_0, Q4_1 and Q8_0 tensors (engine/loader/gguf_blocks.py reads them).

    weight = scale * code            (Q8_0: codes -128..127; Q4_0: codes -8..7)
    weight = scale * code + offset   (Q4_1: codes 0..15)

The scale is a float16 widened to float32 and a code has at most 8 bits, so the product is exact in float32
and the weight has a single rounding: ``dequantize`` gives the same bits whether the last step is a
multiply-add or a multiply then an add, which lets the small-batch matmul kernel keep the weights in this
form and still compute with the very float32 weights the rest of the model sees
(engine/executor/kernels/small_gemm.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block: one scale (and offset) each


@dataclass(frozen=True)
class BlockCodes:
    """A ``[..., K]`` weight as ``codes`` (int8 ``[..., K]``), ``scales`` and ``offsets`` (float32
    ``[..., K / 32]``; ``offsets`` None: the weight is ``scale * code``)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None = None

    def __post_init__(self) -> None:
        k = self.codes.shape[-1]
        blocks = (*self.codes.shape[:-1], k // BLOCK)
        if self.codes.dtype != torch.int8 or k % BLOCK:
            raise ValueError(
                f"codes must be int8 with a multiple of {BLOCK} columns, got {self.codes.dtype} {k}"
            )
        for name, t in (("scales", self.scales), ("offsets", self.offsets)):
            if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != blocks):
                raise ValueError(f"{name} must be float32 of shape {blocks}, got {t.dtype} {tuple(t.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[..., K]``."""
        *rows, k = self.codes.shape
        w = self.codes.view(*rows, k // BLOCK, BLOCK).float().mul_(self.scales.unsqueeze(-1))
        if self.offsets is not None:
            w.add_(self.offsets.unsqueeze(-1))
        return w.view(*rows, k)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BlockCodes:
        """``fn`` (a reordering of dim 0, such as un-permuting q/k heads) applied to all three parts."""
        offsets = None if self.offsets is None else fn(self.offsets)
        return BlockCodes(fn(self.codes).contiguous(), fn(self.scales).contiguous(), offsets)

    @staticmethod
    def cat(parts: Sequence[BlockCodes]) -> BlockCodes | None:
        """The parts' rows one after the other (a fused qkv or gate/up weight); None when some have offsets
        and others not."""
        kinds = {p.offsets is None for p in parts}
        if len(kinds) != 1:
            return None
        offsets = None if kinds == {True} else torch.cat([p.offsets for p in parts if p.offsets is not None])
        return BlockCodes(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), offsets)


def as_four_bit(codes: BlockCodes) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Codes 0..15 and offsets giving the same weights (Q4_0's -8..7 as code + 8 with offset -8 d: exact,
    as d * code is), or None where the codes need 8 bits."""
    lo, hi = (int(v) for v in torch.aminmax(codes.codes))
    if codes.offsets is not None:
        return (codes.codes, codes.offsets) if lo >= 0 and hi <= 15 else None
    if lo >= -8 and hi <= 7:
        return codes.codes + 8, codes.scales * -8.0
    return None
