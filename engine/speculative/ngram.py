"""Prompt lookup (n-gram) drafting: the tokens that followed an earlier occurrence of the sequence's longest
matching suffix (Saxena's prompt lookup decoding; vLLM's ``ngram`` method; transformers'
``prompt_lookup_num_tokens``), the occurrence chosen where the sequence has been copying from.

An output that edits its context (fixes typos, renames a variable, quotes a passage) copies runs of the
context in order, with changes between them. A short suffix (one or two tokens: " the", "(") occurs in many
places; the one that continues the copy is the occurrence just after the last copied source token, not the
latest one in the sequence. So the index keeps a copy cursor: the source position the output is expected to
copy next. It advances while the output follows the source and stays at the first token the output changed.
A proposal takes the suffix's first occurrence whose continuation starts at or after the cursor (within
``CURSOR_REACH`` tokens), else the latest occurrence; when no n-gram matches at all (the output just wrote
something new, a corrected word), it resumes the copy at the first word after the cursor's token.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Collection, Sequence
from typing import Any

CURSOR_REACH = 64  # how far past the cursor an occurrence still continues the copy


class NgramIndex:
    """A sequence's n-grams of ``min_n..max_n`` tokens that have a token after them, each with its starts in
    order, kept as the sequence grows (``update``): a proposal costs ``max_n - min_n + 1`` look-ups and a
    bisection however long the sequence is. ``word_starts``: the token ids whose text begins a word (a space
    or a line break first); None: every token does."""

    def __init__(self, min_n: int, max_n: int, word_starts: Collection[int] | None = None) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.word_starts = word_starts
        self.token_ids: list[int] = []  # the sequence so far
        self._starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its starts with a token after them
        self.cursor: int | None = None  # the source position the output is expected to copy next
        self._source: int | None = None  # where the last proposal's drafts were copied from

    def update(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Index what ``prompt_ids + output_ids`` has past the tokens already indexed (a sequence only
        grows: rejected drafts never enter it), and move the cursor along the output's new tokens."""
        known = len(self.token_ids)
        if known < len(prompt_ids):
            self.extend(prompt_ids[known:])
            known = len(prompt_ids)
        new = len(self.token_ids)
        self.extend(output_ids[known - len(prompt_ids) :])
        self._follow(new)

    def extend(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            end = len(self.token_ids)  # the new token's position: the n-grams that end before it now have one
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._starts.setdefault(tuple(self.token_ids[end - n : end]), []).append(end - n)
            self.token_ids.append(token)

    def _follow(self, first_new: int) -> None:
        """The cursor after the tokens from ``first_new`` on: from where the last drafts were copied (or the
        cursor, without drafts), it passes every new token equal to its source token, and stops at the
        first that differs."""
        source = self._source if self._source is not None else self.cursor
        self._source = None
        if source is None:
            return
        ids = self.token_ids
        for position in range(first_new, len(ids)):
            if source >= position or ids[source] != ids[position]:
                break
            source += 1
        self.cursor = source

    def propose(self, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` drafts: for n from ``max_n`` down to ``min_n``, the last n tokens are looked
        up among the earlier n-grams, and the tokens after the chosen occurrence are the drafts (the first
        at or after the cursor, else the latest); without a match, the tokens from the first word start
        after the cursor; [] when neither exists. A continuation that reaches the end of the sequence
        continues periodically: the sequence is taken to repeat with the continuation's distance from the
        end as its period (a loop, a repeated line), as its own drafts say it does."""
        ids = self.token_ids
        length = len(ids)
        if num_tokens < 1:
            return []
        start = self._matched(length)
        if start is None:
            start = self._resumed(length)
        if start is None:
            return []
        self._source = start
        period = length - start  # the continuation stands that far before the end
        return [ids[start + i % period] for i in range(num_tokens)]

    def _matched(self, length: int) -> int | None:
        """Where the continuation of the longest matching suffix starts, or None."""
        ids = self.token_ids
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            starts = self._starts.get(tuple(ids[length - n :]))
            if not starts:
                continue
            if self.cursor is not None:
                # the first occurrence whose continuation starts at or after the cursor
                i = bisect.bisect_left(starts, self.cursor - n)
                if i < len(starts) and starts[i] + n <= self.cursor + CURSOR_REACH:
                    return starts[i] + n
            return starts[-1] + n
        return None

    def _resumed(self, length: int) -> int | None:
        """The first word start after the cursor's token (the output changed it and goes on), or None."""
        if self.cursor is None:
            return None
        position = self.cursor + 1
        if self.word_starts is not None:
            while position < length and self.token_ids[position] not in self.word_starts:
                position += 1
        return position if position < length else None


_WORD_STARTS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def word_start_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokens that begin a word: their text starts with whitespace (byte-level BPE's " the",
    "\\n") or their piece with SentencePiece's "\u2581" (whose lone decode drops the space). Made once
    per tokenizer (a vocabulary's decodes take ~70 ms), however many managers an engine starts."""
    try:
        starts = _WORD_STARTS.get(tokenizer)
    except TypeError:  # NOTE: a tokenizer that cannot be weakly referenced is not cached.
        return _word_start_ids(tokenizer)
    if starts is None:
        starts = _WORD_STARTS[tokenizer] = _word_start_ids(tokenizer)
    return starts


def _word_start_ids(tokenizer: Any) -> frozenset[int]:
    vocab = range(tokenizer.vocab_size)
    pieces = tokenizer.convert_ids_to_tokens(list(vocab))
    return frozenset(
        i
        for i, piece in zip(vocab, pieces, strict=True)
        if tokenizer.decode([i])[:1].isspace() or (piece or "").startswith("\u2581")
    )
