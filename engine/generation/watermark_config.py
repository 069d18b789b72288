"""A request's watermark: transformers' ``WatermarkingConfig`` (a green list, Kirchenbauer et al.) or
``SynthIDTextWatermarkingConfig`` (SynthID Text's tournament g-values), as frozen, validated values.

``watermarking_config_from(value)`` takes what a caller hands in: one of these, a dict with the fields
of either transformers class (a dict with ``keys`` or ``ngram_len`` is SynthID), or a transformers
config object (anything with ``to_dict()``). A bad value raises ``GenerationConfigError`` whose field is
``watermarking_config.<name>``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.generation.errors import GenerationConfigError

__all__ = ["GreenlistWatermark", "SynthIDWatermark", "Watermark", "watermarking_config_from"]

FIELD = "watermarking_config"
SEEDING_SCHEMES = ("lefthash", "selfhash")
# transformers' SynthIDTextWatermarkingConfig.validate: the sampling table holds at most 2**24 entries.
MAX_SAMPLING_TABLE_SIZE = 2**24
# NOTE: bounds of our own, so that one request cannot make the engine allocate without limit: a step
# computes [vocab, keys] g-values per row, and the context is ngram_len - 1 tokens (the paper's SynthID
# uses 30 keys and n-grams of 5).
MAX_SYNTHID_KEYS = 64
MAX_NGRAM_LEN = 1024
_INT64 = (-(2**63), 2**63 - 1)


def _error(name: str, message: str) -> GenerationConfigError:
    return GenerationConfigError(f"{FIELD}.{name}", message)


def _check_int(name: str, value: Any, low: int, high: int = _INT64[1]) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _error(name, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise _error(name, f"must be in [{low}, {high}], got {value}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _error(name, f"must be a boolean, got {value!r}")


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _error(name, f"must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class GreenlistWatermark:
    """transformers' ``WatermarkingConfig`` (the defaults are its own): ``bias`` is added to the logits of
    the ``greenlist_ratio`` share of the vocabulary that a hash of the last ``context_width`` tokens picks
    (``lefthash``), or, for ``selfhash``, of each of the 40 likeliest candidates whose own green list
    (seeded with the candidate included) holds it."""

    greenlist_ratio: float = 0.25
    bias: float = 2.0
    hashing_key: int = 15485863
    seeding_scheme: str = "lefthash"
    context_width: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "greenlist_ratio", _as_float("greenlist_ratio", self.greenlist_ratio))
        object.__setattr__(self, "bias", _as_float("bias", self.bias))
        if not 0.0 < self.greenlist_ratio < 1.0:
            raise _error("greenlist_ratio", f"must be in (0, 1), got {self.greenlist_ratio}")
        _check_int("hashing_key", self.hashing_key, _INT64[0])
        if self.seeding_scheme not in SEEDING_SCHEMES:
            raise _error(
                "seeding_scheme", f"must be one of {', '.join(SEEDING_SCHEMES)}, got {self.seeding_scheme!r}"
            )
        _check_int("context_width", self.context_width, 1)

    def greenlist_size(self, vocab_size: int) -> int:
        """How many tokens are green (transformers: ``int(vocab_size * greenlist_ratio)``)."""
        return int(vocab_size * self.greenlist_ratio)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SynthIDWatermark:
    """transformers' ``SynthIDTextWatermarkingConfig`` (the defaults are its own): one tournament layer per
    key; each token's g-value at a layer is a bit of a table drawn from ``sampling_table_seed``, indexed
    by a hash of the last ``ngram_len - 1`` generated tokens, the token and the layer's key."""

    ngram_len: int
    keys: tuple[int, ...]
    context_history_size: int = 1024
    sampling_table_seed: int = 0
    sampling_table_size: int = 2**16
    skip_first_ngram_calls: bool = False
    debug_mode: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.keys, (list, tuple)) or not self.keys:
            raise _error("keys", f"must be a non-empty list of integers, got {self.keys!r}")
        if len(self.keys) > MAX_SYNTHID_KEYS:
            raise _error("keys", f"at most {MAX_SYNTHID_KEYS} keys (tournament layers), got {len(self.keys)}")
        for key in self.keys:
            _check_int("keys", key, _INT64[0])
        object.__setattr__(self, "keys", tuple(self.keys))
        # NOTE: 2 at least: an n-gram of one token has no context, so every call after the first would
        # count as a repeated context and go unwatermarked.
        _check_int("ngram_len", self.ngram_len, 2, MAX_NGRAM_LEN)
        _check_int("context_history_size", self.context_history_size, 1)
        _check_int("sampling_table_seed", self.sampling_table_seed, _INT64[0])
        _check_int("sampling_table_size", self.sampling_table_size, 1, MAX_SAMPLING_TABLE_SIZE)
        _check_bool("skip_first_ngram_calls", self.skip_first_ngram_calls)
        _check_bool("debug_mode", self.debug_mode)

    @property
    def depth(self) -> int:
        """The number of tournament layers (one per key)."""
        return len(self.keys)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["keys"] = list(self.keys)
        return out


Watermark = GreenlistWatermark | SynthIDWatermark

_SYNTHID_ONLY = {"keys", "ngram_len", "context_history_size", "sampling_table_seed", "sampling_table_size"}


def watermarking_config_from(value: Any) -> Watermark | None:
    """``value`` as a validated watermark: None, one of ours, a dict, or a transformers config object."""
    if value is None or isinstance(value, (GreenlistWatermark, SynthIDWatermark)):
        return value
    if not isinstance(value, Mapping) and callable(getattr(value, "to_dict", None)):
        value = value.to_dict()  # transformers' WatermarkingConfig / SynthIDTextWatermarkingConfig
    if not isinstance(value, Mapping):
        raise GenerationConfigError(
            FIELD,
            f"must be an object with WatermarkingConfig or SynthIDTextWatermarkingConfig fields, got {value!r}",
        )
    kind: type[GreenlistWatermark] | type[SynthIDWatermark] = (
        SynthIDWatermark if _SYNTHID_ONLY & set(value) else GreenlistWatermark
    )
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(str(k) for k in value if k not in names)
    if unknown:
        raise _error(unknown[0], f"unknown field for {kind.__name__} (known: {', '.join(sorted(names))})")
    if kind is SynthIDWatermark:
        for required in ("ngram_len", "keys"):
            if required not in value:
                raise _error(required, "is required for a SynthID watermark")
    try:
        return kind(**{str(k): v for k, v in value.items()})
    except TypeError as exc:  # NOTE: a non-string key; the dataclass names the problem.
        raise GenerationConfigError(FIELD, str(exc)) from None
