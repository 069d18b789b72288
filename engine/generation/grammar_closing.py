"""Closing a JSON output before ``max_new_tokens`` cuts it.

A grammar mask keeps every token valid, but not every output finished: a small model that loops inside an
array or a string (``"hiking", "hiking", ...``, ``1.1.1.1...``) runs until ``max_new_tokens`` and ends
with ``finish_reason: "length"`` and JSON that does not parse. To end such an output as a complete value
instead, each sequence's ``ClosingBudget`` watches how many tokens are left and plans a way to close the
grammar from where the output is:

- ``ClosingPlanner.plan`` walks a copy of the matcher one byte at a time, taking at each step the first
  byte the grammar allows from ``CLOSING_BYTES`` (closers and separators before digits, digits before
  letters: ``"`` ends a string, ``}``/``]`` end containers, ``,`` moves on to a required key, ``0`` is
  the shortest number) until the grammar accepts. The bytes are a completion, not necessarily the
  shortest: an upper bound on the tokens needed, since every token covers at least one byte.
- While the plan plus ``MARGIN`` still fits in the tokens left (one kept for EOS), the model is free.
  Once it does not, the row's mask keeps only tokens whose bytes begin the plan (the model still picks
  among them, e.g. ``"}`` or ``"`` then ``}``), and EOS once the plan is empty. Every forced token covers
  at least one byte of the plan, so the output closes within the budget.

Only JSON grammars (``json_schema``, ``json_object``, forced tool calls) close this way: a closed object
is a complete answer, while a free-text reply or a regex match cut short would only look complete.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

import llguidance
import torch

# NOTE: the order decides which completion the greedy walk finds; closers and separators come first so
# that it ends strings, containers and numbers instead of extending them.
CLOSING_BYTES = (
    b'"}],:0123456789{['
    + string.ascii_lowercase.encode()
    + string.ascii_uppercase.encode()
    + b" -._/@+#$%&*!?;<=>()^~|\\'`\n\t"
)
MARGIN = 16  # tokens of slack before closing: one free token can lengthen the plan (a new key, a new item)
REFRESH_EVERY = 16  # far from the end of the budget, re-plan this often to follow the plan's length
MAX_PLAN_BYTES = 1024


class ClosingPlanner:
    """Per vocabulary: the single-byte tokens the walk tries and every token's bytes (for prefixes)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> None:
        self._by_bytes: dict[bytes, int] = {}
        for token_id in range(min(vocab_size, tokenizer.vocab_size)):
            if tokenizer.is_special_token(token_id):
                continue
            data = tokenizer.decode_bytes([token_id])
            if data and data not in self._by_bytes:
                self._by_bytes[data] = token_id
        self._steps = [
            (bytes([b]), self._by_bytes[bytes([b])]) for b in CLOSING_BYTES if bytes([b]) in self._by_bytes
        ]
        self._max_token_bytes = max((len(b) for b in self._by_bytes), default=1)

    def plan(self, matcher: llguidance.LLMatcher, max_bytes: int) -> bytes | None:
        """Bytes that take ``matcher``'s grammar to an accepting state, at most ``max_bytes`` of them;
        None when the walk finds none (it may loop in grammars that are not JSON)."""
        walk = matcher.deep_copy()
        out = bytearray()
        while not walk.is_accepting():
            if len(out) >= max_bytes:
                return None
            for data, token_id in self._steps:
                if walk.validate_tokens([token_id]) == 1:
                    walk.consume_token(token_id)
                    out += data
                    break
            else:
                return None
        return bytes(out)

    def prefix_tokens(self, plan: bytes) -> list[int]:
        """The tokens whose bytes are a non-empty prefix of ``plan``."""
        found = (self._by_bytes.get(plan[:k]) for k in range(1, min(len(plan), self._max_token_bytes) + 1))
        return [t for t in found if t is not None]


class ClosingBudget:
    """One sequence's watch over its remaining tokens (see the module docstring)."""

    def __init__(self, planner: ClosingPlanner, max_new_tokens: int) -> None:
        self.planner = planner
        self.max_new_tokens = max_new_tokens
        self.num_accepted = 0
        self._plan_len = 0  # length of the last plan, in bytes

    def copy(self) -> ClosingBudget:
        twin = ClosingBudget(self.planner, self.max_new_tokens)
        twin.num_accepted, twin._plan_len = self.num_accepted, self._plan_len
        return twin

    def restrict(
        self, matcher: llguidance.LLMatcher, words: torch.Tensor, eos_token_ids: Sequence[int]
    ) -> None:
        """Narrow ``words`` (the row's bitmask, the grammar's tokens and EOS already set) to the plan's
        first tokens once the budget needs closing; leave it alone before that."""
        left = self.max_new_tokens - self.num_accepted  # this token included
        near_end = left <= self._plan_len + MARGIN + 1 + REFRESH_EVERY
        if not near_end and self.num_accepted % REFRESH_EVERY:
            return
        plan = self.planner.plan(matcher, min(left, MAX_PLAN_BYTES))
        if plan is None:
            return
        self._plan_len = len(plan)
        if len(plan) + 1 + MARGIN < left:
            return
        allowed = self.planner.prefix_tokens(plan) if plan else list(eos_token_ids)
        keep = [t for t in allowed if t < 32 * words.numel() and (int(words[t // 32]) >> (t % 32)) & 1]
        if not keep:
            return
        words.zero_()
        for t in keep:
            words[t // 32] |= signed_bit(t % 32)


def signed_bit(bit: int) -> int:
    """Bit ``bit`` of an int32 bitmask word as a signed value (bit 31 is the sign bit)."""
    return (1 << bit) - (1 << 32) if bit == 31 else 1 << bit
