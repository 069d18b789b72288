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
    match are the drafts; [] when no n-gram matches."""
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
            return ids[start : start + num_tokens].tolist()
    return []
