"""Which rows of a forward are decode rows (engine/executor/models/row_kinds.py), and the split of a call by
row kind (engine/executor/kernels/modules.py's ``by_kind``): the kinds of a selection of rows, in its order;
``current`` only for a call on the forward's rows; each row through its kind's function, in place, whether
the decode rows come first or not. End to end: tests/engine/test_batch_invariance.py (bfloat16)."""

from __future__ import annotations

import torch

from engine.executor.kernels.modules import by_kind
from engine.executor.models import row_kinds
from engine.executor.models.row_kinds import RowKinds


def test_the_kinds_of_a_selection_of_rows() -> None:
    kinds = row_kinds.decode_rows(3, 7)  # rows 0-2 decode, 3-6 prefill
    assert kinds.mask().tolist() == [True] * 3 + [False] * 4
    first = kinds.select(torch.tensor([0, 2, 5]))
    assert (first.count, first.first, first.decode) == (3, 2, None)  # still the decode rows first
    mixed = kinds.select(torch.tensor([1, 5, 2, 6, 1]))  # contrastive search's hidden rows after the logits'
    assert (mixed.count, mixed.first) == (5, 3)
    assert mixed.decode is not None and mixed.decode.tolist() == [True, False, True, False, True]
    assert kinds.select(torch.tensor([4, 6])).first == 0


def test_current_only_inside_a_forward_and_for_its_rows() -> None:
    assert row_kinds.current(5) is None
    kinds = row_kinds.decode_rows(2, 5)
    with row_kinds.rows_of(kinds):
        assert row_kinds.current(5) == kinds
        assert row_kinds.current(4) is None  # a call on other rows (the head's, a subset)
        with row_kinds.selected(torch.tensor([3, 0])):
            inner = row_kinds.current(2)
            assert inner is not None and inner.mask().tolist() == [False, True]
        with row_kinds.selected(None):
            assert row_kinds.current(5) == kinds
        assert row_kinds.current(5) == kinds
    assert row_kinds.current(5) is None
    with row_kinds.selected(torch.tensor([0])):  # outside a forward: nothing to select from
        assert row_kinds.current(1) is None


def test_each_row_goes_through_its_kinds_function_in_place() -> None:
    x = torch.arange(12.0).view(6, 2)
    calls: list[tuple[str, int]] = []

    def decode(rows: torch.Tensor) -> torch.Tensor:
        calls.append(("decode", rows.shape[0]))
        return torch.cat([rows * 2, rows.sum(-1, keepdim=True)], dim=-1)  # another width than x's

    def prefill(rows: torch.Tensor) -> torch.Tensor:
        calls.append(("prefill", rows.shape[0]))
        return torch.cat([rows + 100, rows.sum(-1, keepdim=True)], dim=-1)

    def expected(mask: list[bool]) -> torch.Tensor:
        return torch.stack(
            [decode(r[None])[0] if d else prefill(r[None])[0] for r, d in zip(x, mask, strict=True)]
        )

    for kinds in (
        row_kinds.decode_rows(6, 6),
        row_kinds.decode_rows(0, 6),
        row_kinds.decode_rows(2, 6),
        RowKinds(6, 3, torch.tensor([False, True, True, False, True, False])),
    ):
        calls.clear()
        ours = by_kind(x, kinds, decode, prefill)
        assert len(calls) == (1 if kinds.first in (0, 6) else 2)  # one call per kind present
        assert torch.equal(ours, expected(kinds.mask().tolist()))
