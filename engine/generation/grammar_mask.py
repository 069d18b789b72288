"""The grammar masks of a step's constrained rows, applied to their logits in one op.

Each constrained row's matcher fills its row of one int32 bitmask ``[C, ceil(V / 32)]``; the bits are
unpacked once and every disallowed token's logit becomes -inf. This runs before the logits processors,
so the logprobs a request sees are those of the constrained distribution. A matcher that fails marks
only its own row as failed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.generation.grammar import bitmask_words
from engine.generation.processors import row_eos_token_ids
from engine.generation.rows import SamplingRow

_BITS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """``logits[rows[j], t] = -inf`` wherever bit ``t`` of ``bitmask[j]`` is clear, in place."""
    num_rows, vocab = logits.shape[0], logits.shape[1]
    allowed = ((bitmask.unsqueeze(2) >> _BITS) & 1).view(len(rows), -1)[:, :vocab].bool()  # [C, V]
    allowed = allowed.to(logits.device)
    if rows == list(range(num_rows)):
        logits.masked_fill_(~allowed, float("-inf"))
        return
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    sub = logits.index_select(0, idx)  # [C, V]
    logits.index_copy_(0, idx, sub.masked_fill_(~allowed, float("-inf")))


def apply_grammar_masks(
    logits: torch.Tensor, rows: Sequence[SamplingRow], errors: list[str | None], default_eos: tuple[int, ...]
) -> None:
    """Mask every row that has a grammar (and no error yet); a matcher that raises sets ``errors[i]``.
    ``default_eos``: the model's EOS ids, for rows that name none."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None and errors[i] is None]
    if not constrained:
        return
    bitmask = torch.zeros((len(constrained), bitmask_words(logits.shape[1])), dtype=torch.int32)
    for j, i in enumerate(constrained):
        row = rows[i]
        assert row.grammar is not None  # NOTE: filtered above; narrows for mypy.
        try:
            row.grammar.fill_bitmask(bitmask, j, row_eos_token_ids(row, default_eos))
        except Exception as exc:  # NOTE: one request's grammar must not take the batch down.
            errors[i] = f"the grammar matcher failed: {exc}"
            bitmask[j] = -1  # the row is failed anyway; leave its logits as they are
    apply_token_bitmask(logits, bitmask, constrained)
