"""Prompt lookup (n-gram) drafting: the tokens that followed the latest earlier occurrence of the
sequence's longest matching suffix (Saxena's prompt lookup decoding; vLLM's ``ngram`` method; transformers'
``prompt_lookup_num_tokens``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Up to ``num_tokens`` drafts for ``token_ids`` (prompt + output): for n from ``max_n`` down to
    ``min_n``, the last n tokens are looked up among the earlier n-grams, and the tokens after the latest
    match are the drafts; [] when no n-gram matches. A match whose continuation reaches the end of the
    sequence continues periodically: the sequence is taken to repeat with the match's distance from the
    end as its period (a loop, a repeated line), as its own drafts say it does."""
    length = len(token_ids)
    if num_tokens < 1 or length < min_n + 1:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # NOTE: n-grams of ids[:-1] only: each has a token after it, and the suffix itself is not one.
        windows = sliding_window_view(ids[:-1], n)  # [length - n, n]
        matches = np.flatnonzero((windows == ids[length - n :]).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n
            period = length - start  # the match's tokens stand that far before the suffix's
            return ids[start + np.arange(num_tokens) % period].tolist()
    return []
