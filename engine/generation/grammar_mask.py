"""The grammar masks of a step's constrained rows, applied to their logits in one op.

Each constrained row's matcher fills its row of one int32 bitmask ``[C, ceil(V / 32)]``
(``compute_grammar_masks``, which the engine runs on a worker thread while the forward runs:
engine/generation/mask_prefetch.py); the bits are unpacked once and every disallowed token's logit becomes
-inf (``apply_grammar_masks``). This runs before the logits processors,
so the logprobs a request sees are those of the constrained distribution. A matcher that fails marks
only its own row as failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass
class GrammarMasks:
    """A step's grammar masks: ``bitmask[j]`` is row ``constrained[j]``'s; ``errors[i]`` says why row
    ``i``'s matcher failed (its bitmask row is all ones: the row fails anyway)."""

    constrained: list[int]
    bitmask: torch.Tensor  # [len(constrained), ceil(V / 32)] int32
    errors: dict[int, str]


def compute_grammar_masks(
    rows: Sequence[SamplingRow], vocab_size: int, default_eos: tuple[int, ...]
) -> GrammarMasks:
    """Every constrained row's mask over ``vocab_size`` tokens. ``default_eos``: the model's EOS ids, for rows
    that name none. Reads the matchers only: safe on another thread while nothing advances them."""
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    bitmask = torch.zeros((len(constrained), bitmask_words(vocab_size)), dtype=torch.int32)
    errors: dict[int, str] = {}
    for j, i in enumerate(constrained):
        row = rows[i]
        assert row.grammar is not None  # NOTE: filtered above; narrows for mypy.
        try:
            row.grammar.fill_bitmask(bitmask, j, row_eos_token_ids(row, default_eos))
        except Exception as exc:  # NOTE: one request's grammar must not take the batch down.
            errors[i] = f"the grammar matcher failed: {exc}"
            bitmask[j] = -1  # the row is failed anyway; leave its logits as they are
    return GrammarMasks(constrained, bitmask, errors)


def apply_grammar_masks(logits: torch.Tensor, masks: GrammarMasks, errors: list[str | None]) -> None:
    """Mask every constrained row of ``logits`` that has no error yet; a matcher that failed sets
    ``errors[i]``."""
    for i, message in masks.errors.items():
        if errors[i] is None:
            errors[i] = message
    keep = [j for j, i in enumerate(masks.constrained) if errors[i] is None]
    if not keep:
        return
    bitmask = masks.bitmask if len(keep) == len(masks.constrained) else masks.bitmask[keep]
    apply_token_bitmask(logits, bitmask, [masks.constrained[j] for j in keep])
