"""Which rows of the forward in progress are decode rows: a sequence's one new token in its decode phase (or
a token of a speculative verify run), the rows ``BatchInputs`` puts first (``num_decode_seqs``); the others
are prefill rows (prompt chunks).

Why: a kernel may compute the two kinds differently -- bfloat16 decode rows read 4-bit codes with their
scales applied after the tile unit, prefill rows the loaded bfloat16 weights (kernels/amx_qgemm.py), whose
bits differ -- and a row's result must not depend on the rest of its step. So the kernel chooses by the
row's kind, never by how many rows the call has: the model's forward says which rows are which
(``decode_rows``), and the modules that care read it (``current``), for the call whose rows are those
(a module called on other rows -- a subset, the output head's -- sees no kinds).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowKinds:
    """The kinds of ``count`` rows: ``decode`` is a bool per row, or None where exactly rows ``[0, first)``
    are decode rows (the batch's own order)."""

    count: int
    first: int
    decode: torch.Tensor | None = None

    def mask(self) -> torch.Tensor:
        """A bool per row: whether it is a decode row."""
        if self.decode is not None:
            return self.decode
        return torch.arange(self.count) < self.first

    def select(self, rows: torch.Tensor) -> RowKinds:
        """The kinds of the rows ``rows`` (indices into these), in that order."""
        decode = self.mask()[rows.cpu()]
        first = int(decode.sum())
        if bool(decode[:first].all()):
            return RowKinds(len(decode), first)
        return RowKinds(len(decode), first, decode)


_current: ContextVar[RowKinds | None] = ContextVar("row_kinds", default=None)


def current(num_rows: int) -> RowKinds | None:
    """The kinds of the rows of a call of ``num_rows`` rows inside a model's forward, or None (no forward
    in progress, or a call on other rows)."""
    kinds = _current.get()
    return kinds if kinds is not None and kinds.count == num_rows else None


@contextmanager
def rows_of(kinds: RowKinds) -> Iterator[None]:
    """Within: ``current`` gives ``kinds``."""
    token = _current.set(kinds)
    try:
        yield
    finally:
        _current.reset(token)


def decode_rows(num_decode: int, num_rows: int) -> RowKinds:
    """A batch's kinds: its first ``num_decode`` rows decode rows, the other prefill rows."""
    return RowKinds(num_rows, num_decode)


@contextmanager
def selected(rows: torch.Tensor | None) -> Iterator[None]:
    """Within: the kinds of the rows ``rows`` of the current ones, in that order (where a forward goes on
    with some of its rows: a last layer's rows that need logits); unchanged for None or outside a forward."""
    kinds = _current.get()
    if rows is None or kinds is None:
        yield
        return
    with rows_of(kinds.select(rows)):
        yield
