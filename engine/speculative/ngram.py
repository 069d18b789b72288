"""Prompt lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence of the
sequence's longest matching suffix (Saxena's prompt lookup decoding; vLLM's ``ngram`` method; transformers'
``prompt_lookup_num_tokens``)."""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """A sequence's n-grams of ``min_n..max_n`` tokens that have a token after them, each at its latest
    start, kept as the sequence grows (``update``): a proposal costs ``max_n - min_n + 1`` look-ups however
    long the sequence is (a search of the whole sequence at every step grows with it)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.token_ids: list[int] = []  # the sequence so far
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> its latest start with a token after it

    def update(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Index what ``prompt_ids + output_ids`` has past the tokens already indexed (a sequence only
        grows: rejected drafts never enter it)."""
        known = len(self.token_ids)
        if known < len(prompt_ids):
            self.extend(prompt_ids[known:])
            known = len(prompt_ids)
        self.extend(output_ids[known - len(prompt_ids) :])

    def extend(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            end = len(self.token_ids)  # the new token's position: the n-grams that end before it now have one
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._latest[tuple(self.token_ids[end - n : end])] = end - n
            self.token_ids.append(token)

    def propose(self, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` drafts: for n from ``max_n`` down to ``min_n``, the last n tokens are looked
        up among the earlier n-grams, and the tokens after the latest match are the drafts; [] when no
        n-gram matches. A match whose continuation reaches the end of the sequence continues periodically:
        the sequence is taken to repeat with the match's distance from the end as its period (a loop, a
        repeated line), as its own drafts say it does."""
        ids = self.token_ids
        length = len(ids)
        if num_tokens < 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._latest.get(tuple(ids[length - n :]))
            if start is not None:
                start += n
                period = length - start  # the match's tokens stand that far before the suffix's
                return [ids[start + i % period] for i in range(num_tokens)]
        return []
