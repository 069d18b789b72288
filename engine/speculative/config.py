"""How a server speculates (``--speculative-config``, vLLM's spelling) and how one request does.

Server-wide: ``{"method": "ngram" | "early_exit" | "draft_model", "num_speculative_tokens": K,
"prompt_lookup_min": .., "prompt_lookup_max": .., "num_layers": .. (early_exit), "model": .. (draft_model:
what ``--model`` takes, with the target's vocabulary), "num_assistant_tokens_schedule": "heuristic" |
"constant" (default: the method's, ``default_schedule``), "disable_by_batch_size": ..}``. Per request,
transformers' names: ``prompt_lookup_num_tokens`` (prompt lookup for this request, server config or not;
0 turns speculation off for it), ``max_matching_ngram_size``, ``assistant_early_exit`` (self-speculation
through that many layers, server config or not), ``assistant_confidence_threshold`` (early exit: stop
drafting below it), ``num_assistant_tokens`` and ``num_assistant_tokens_schedule`` (over the server's
method).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.generation.config import GenerationConfig
from engine.generation.errors import GenerationConfigError
from engine.generation.speculation import (
    DEFAULT_MAX_MATCHING_NGRAM_SIZE,
    MAX_SPECULATIVE_TOKENS,
    SCHEDULES,
    Speculation,
    default_schedule,
)

METHODS = ("ngram", "early_exit", "draft_model")
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
# More running requests than this and nobody drafts: the step is compute-bound, verifying costs more than
# it saves (measured in docs/BENCHMARKS.md, "Speculative decoding").
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


class SpeculativeConfigError(ValueError):
    """A bad ``--speculative-config`` (or ``speculative_config=``)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """The server's speculation; see the module doc for the fields."""

    method: str
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    num_layers: int | None = None  # early_exit: the layers that draft
    model: str | None = None  # draft_model: the model that drafts (a path or a name --model takes)
    load_format: str = "auto"  # draft_model: how to read it ("dummy": random weights of a preset)
    num_assistant_tokens_schedule: str | None = None  # None: the method's (``default_schedule``)
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeculativeConfig:
        if not isinstance(d, Mapping):
            raise SpeculativeConfigError(f"the speculative config must be a JSON object, got {d!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"unknown speculative config field {unknown[0]!r} (known: {', '.join(sorted(known))})"
            )
        if "method" not in d:
            raise SpeculativeConfigError(
                f"the speculative config needs a method: one of {', '.join(METHODS)}"
            )
        config = cls(**d)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                f"unknown speculative method {self.method!r} (known: {', '.join(METHODS)})"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, 64)
        _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 20)
        if self.method == "early_exit":
            if self.num_layers is None:
                raise SpeculativeConfigError("the early_exit method needs num_layers: the layers that draft")
            _check_int("num_layers", self.num_layers, 1, 1 << 10)
        elif self.num_layers is not None:
            raise SpeculativeConfigError(f"num_layers applies to the early_exit method, not {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise SpeculativeConfigError(
                "the draft_model method, and it alone, needs model: the model that drafts"
            )
        if self.num_assistant_tokens_schedule not in (None, *SCHEDULES):
            raise SpeculativeConfigError(
                f"num_assistant_tokens_schedule must be one of {', '.join(SCHEDULES)}, "
                f"got {self.num_assistant_tokens_schedule!r}"
            )


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpeculativeConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def speculation_for(config: GenerationConfig, server: SpeculativeConfig | None) -> Speculation | None:
    """How a request speculates: prompt lookup or early exit when it asks (``prompt_lookup_num_tokens``,
    ``assistant_early_exit``), else the server's method with the request's overrides, else not at all.
    DoLa requests do not speculate. Raises ``GenerationConfigError`` for overrides a server without
    speculation cannot honour."""
    schedule = config.num_assistant_tokens_schedule or (
        server.num_assistant_tokens_schedule if server else None
    )
    ngram = server is not None and server.method == "ngram"
    if config.prompt_lookup_num_tokens == 0:
        return None
    threshold = config.assistant_confidence_threshold or 0.0
    num_tokens = config.num_assistant_tokens or (server.num_speculative_tokens if server else None)
    if config.prompt_lookup_num_tokens is not None:
        max_n = config.max_matching_ngram_size or (
            server.prompt_lookup_max if server is not None and ngram else DEFAULT_MAX_MATCHING_NGRAM_SIZE
        )
        min_n = min(server.prompt_lookup_min if server is not None and ngram else 1, max_n)
        return Speculation(
            "ngram", config.prompt_lookup_num_tokens, min_n, max_n, schedule or default_schedule("ngram")
        )
    if config.assistant_early_exit is not None:
        k = num_tokens or DEFAULT_NUM_SPECULATIVE_TOKENS
        return Speculation(
            "early_exit", k, schedule=schedule or default_schedule("early_exit"),
            num_layers=config.assistant_early_exit,
            confidence_threshold=threshold,
        )  # fmt: skip
    if server is None:
        for name in _NEEDS_A_SERVER_METHOD:
            if getattr(config, name) is not None:
                raise GenerationConfigError(
                    name,
                    "this server does not speculate (--speculative-config); prompt_lookup_num_tokens or "
                    "assistant_early_exit turn speculation on for one request",
                )
        return None
    if config.dola_layers is not None:
        return None
    max_n = config.max_matching_ngram_size or server.prompt_lookup_max
    return Speculation(
        server.method,
        num_tokens or server.num_speculative_tokens,
        min(server.prompt_lookup_min, max_n),
        max_n,
        schedule or default_schedule(server.method),
        num_layers=server.num_layers,
        confidence_threshold=threshold,
    )


_NEEDS_A_SERVER_METHOD = (
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "max_matching_ngram_size",
    "assistant_confidence_threshold",
)
