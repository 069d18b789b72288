"""Is a text watermarked? ``detect_watermark(token_ids, config, vocab_size, ...)``.

Green list (``GreenlistWatermark``): transformers' ``WatermarkDetector``, number for number. A leading BOS
is dropped; each token after the first ``context_width`` (``context_width - 1`` for selfhash) is scored
green or not by the green list of the tokens before it (selfhash: of the window ending with it);
``z = (green - ratio * scored) / sqrt(scored * ratio * (1 - ratio))``, the one-sided normal p-value, and
``prediction = z > z_threshold``. ``ignore_repeated_ngrams`` counts each distinct n-gram once.

SynthID (``SynthIDWatermark``): the g-values of every n-gram of the text, masked as transformers'
``SynthIDTextWatermarkDetector`` masks them (repeated contexts, and everything from the first EOS on), and
the reference scores of SynthID Text: ``mean_score`` (the mean unmasked g-value) and
``weighted_mean_score`` (layer weights from 10 down to 1, normalised to sum to the depth). Unwatermarked
text has g-values that are fair coin flips, so ``z_score`` is the mean's distance from 1/2 in standard
errors of ``scored * depth`` such flips, with its p-value and ``prediction = z > z_threshold``; there is
no trained Bayesian detector here.

Pass the generated tokens alone: a prompt that was not watermarked dilutes the score.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import InvalidRequestError
from engine.generation.errors import GenerationConfigError
from engine.generation.watermark_config import GreenlistWatermark, SynthIDWatermark, Watermark
from engine.generation.watermark_hash import context_hashes, g_values, is_green

__all__ = ["DEFAULT_Z_THRESHOLD", "WatermarkDetection", "detect_watermark"]

# transformers' WatermarkDetector default.
DEFAULT_Z_THRESHOLD = 3.0


@dataclass(frozen=True)
class WatermarkDetection:
    """One text's score. The green-list fields are None for SynthID and the SynthID ones for a green list."""

    num_tokens_scored: int
    z_score: float
    p_value: float
    prediction: bool
    num_green_tokens: int | None = None
    green_fraction: float | None = None
    mean_score: float | None = None
    weighted_mean_score: float | None = None


def _p_value(z: float) -> float:
    """The one-sided normal tail above ``z``, computed as transformers' detector does (float64 erfc)."""
    return float(0.5 * torch.special.erfc(torch.as_tensor(z / math.sqrt(2), dtype=torch.float64)))


def _z_score(hits: float, total: float, rate: float) -> float:
    """transformers' ``_compute_z_score``: ``(hits - rate * total) / sqrt(total * rate * (1 - rate))``."""
    # NOTE: numpy's float64 arithmetic, as transformers' arrays use; a zero denominator gives inf/nan.
    with np.errstate(divide="ignore", invalid="ignore"):
        numer = np.float64(hits) - rate * np.float64(total)
        denom = np.sqrt(np.float64(total) * rate * (1 - rate))
        return float(numer / denom)


def _score_greenlist(
    tokens: list[int],
    config: GreenlistWatermark,
    vocab_size: int,
    ignore_repeated_ngrams: bool,
) -> tuple[int, int]:
    """(tokens scored, green tokens) over every n-gram of ``tokens``, transformers' way."""
    selfhash = config.seeding_scheme == "selfhash"
    n = config.context_width + 1 - int(selfhash)
    frequencies = collections.Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
    green = {
        ngram: is_green(config, vocab_size, ngram if selfhash else ngram[:-1], ngram[-1])
        for ngram in frequencies
    }
    if ignore_repeated_ngrams:
        return len(frequencies), sum(green.values())
    return sum(frequencies.values()), sum(freq * green[ngram] for ngram, freq in frequencies.items())


def _detect_greenlist(
    tokens: list[int],
    config: GreenlistWatermark,
    vocab_size: int,
    z_threshold: float,
    ignore_repeated_ngrams: bool,
) -> WatermarkDetection:
    if len(tokens) - config.context_width < 1:
        raise InvalidRequestError(
            f"watermark detection needs at least {config.context_width + 1} tokens (context_width "
            f"{config.context_width} to seed from, then 1 to score), got {len(tokens)}",
            param="tokens",
        )
    scored, green = _score_greenlist(tokens, config, vocab_size, ignore_repeated_ngrams)
    z = _z_score(green, scored, config.greenlist_ratio)
    return WatermarkDetection(
        num_tokens_scored=scored,
        num_green_tokens=green,
        green_fraction=green / scored,
        z_score=z,
        p_value=_p_value(z),
        prediction=bool(z > z_threshold),
    )


def synthid_mask(config: SynthIDWatermark, tokens: list[int], eos_token_id: int | None) -> torch.Tensor:
    """transformers' detector mask of each n-gram of ``tokens`` (bool ``[len - ngram_len + 1]``): its
    context not seen in the previous ``context_history_size`` contexts, and no EOS at or before its end."""
    width = config.ngram_len - 1
    contexts = torch.tensor(tokens[:-1], dtype=torch.int64).unfold(0, width, 1)  # [num_ngrams, width]
    # NOTE: transformers keeps the last context_history_size hashes, zeros at first; a hash is in that
    # history when it was last seen at most context_history_size contexts ago (or is 0, while zeros remain).
    last_seen: dict[int, int] = {}
    fresh: list[bool] = []
    for i, h in enumerate(context_hashes(contexts).tolist()):
        seen = i - last_seen[h] <= config.context_history_size if h in last_seen else False
        fresh.append(not (seen or (h == 0 and i < config.context_history_size)))
        last_seen[h] = i
    mask = torch.tensor(fresh, dtype=torch.bool)
    if eos_token_id is not None and eos_token_id in tokens:
        first_eos = tokens.index(eos_token_id)
        ends = torch.arange(width, len(tokens))  # the position of each n-gram's last token
        mask &= ends < first_eos
    return mask


def _detect_synthid(
    tokens: list[int], config: SynthIDWatermark, eos_token_id: int | None, z_threshold: float
) -> WatermarkDetection:
    if len(tokens) < config.ngram_len:
        raise InvalidRequestError(
            f"watermark detection needs at least ngram_len ({config.ngram_len}) tokens, got {len(tokens)}",
            param="tokens",
        )
    ids = torch.tensor(tokens, dtype=torch.int64)
    ngrams = ids.unfold(0, config.ngram_len, 1)  # [num_ngrams, ngram_len]
    g = g_values(config, context_hashes(ngrams[:, :-1]), ngrams[:, -1:])[
        :, 0, :
    ].double()  # [num_ngrams, depth]
    mask = synthid_mask(config, tokens, eos_token_id)
    scored = int(mask.sum())
    if scored == 0:
        raise InvalidRequestError(
            "watermark detection found no n-gram to score (every context repeated, or EOS too early)",
            param="tokens",
        )
    depth = config.depth
    kept = g[mask]  # [scored, depth]
    mean = float(kept.sum() / (depth * scored))
    weights = torch.linspace(10, 1, depth, dtype=torch.float64)
    weights = weights * depth / weights.sum()
    weighted = float((kept * weights).sum() / (depth * scored))
    z = (mean - 0.5) / math.sqrt(0.25 / (depth * scored))
    return WatermarkDetection(
        num_tokens_scored=scored,
        mean_score=mean,
        weighted_mean_score=weighted,
        z_score=z,
        p_value=_p_value(z),
        prediction=bool(z > z_threshold),
    )


def detect_watermark(
    token_ids: Sequence[int],
    config: Watermark,
    vocab_size: int,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    z_threshold: float = DEFAULT_Z_THRESHOLD,
    ignore_repeated_ngrams: bool = False,
) -> WatermarkDetection:
    """Score ``token_ids`` (the generated tokens) against the watermark ``config`` used to generate them.

    ``vocab_size``: the model's (the green lists are permutations of it). ``bos_token_id``: dropped when
    it leads (green list, as transformers' detector does). ``eos_token_id``: SynthID ignores the n-grams
    from the first EOS on. Too few tokens to score, or a token outside the vocabulary, raises
    ``InvalidRequestError`` (param ``tokens``); a bad ``z_threshold`` ``GenerationConfigError``."""
    bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})", param="tokens"
        )
    if (
        isinstance(z_threshold, bool)
        or not isinstance(z_threshold, (int, float))
        or not math.isfinite(z_threshold)
    ):
        raise GenerationConfigError("z_threshold", f"must be a finite number, got {z_threshold!r}")
    tokens = list(token_ids)
    if isinstance(config, SynthIDWatermark):
        return _detect_synthid(tokens, config, eos_token_id, z_threshold)
    if tokens and bos_token_id is not None and tokens[0] == bos_token_id:
        tokens = tokens[1:]
    return _detect_greenlist(tokens, config, vocab_size, z_threshold, ignore_repeated_ngrams)
