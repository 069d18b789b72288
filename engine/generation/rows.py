"""The sampler's per-row input (``SamplingRow``) and output (``SampledToken``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.generation.config import GenerationConfig
from engine.generation.grammar import GrammarMatcher
from engine.generation.rng import RequestRNG
from engine.generation.user_processors import RequestHooks
from engine.outputs import TokenLogprob


@dataclass(frozen=True)
class SamplingRow:
    """One row of the step's logits and what the processors need to know about its sequence.

    A request with ``num_return_sequences > 1`` may appear several times (same prompt and logits, a
    different ``rng`` stream each). ``eos_token_ids`` are the resolved EOS ids used by min_new_tokens
    masking and bad_words filtering; ``None`` falls back to ``config.eos_token_id``, then to the
    sampler's model default. ``grammar``: the sequence's matcher when its output is constrained (its
    mask applies before every processor). ``hooks``: the request's own transformers-style processors.
    """

    config: GenerationConfig
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    rng: RequestRNG | None = None
    eos_token_ids: tuple[int, ...] | None = None
    grammar: GrammarMatcher | None = None
    hooks: RequestHooks | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)


@dataclass(frozen=True)
class SampledToken:
    """The token chosen for one row. ``error`` is set (and ``token_id`` is -1) when that row alone could
    not be sampled (NaN/inf logits, every token masked, a user processor that failed): the engine fails
    that request only. ``error_code`` is set when the request's own options or processors caused it (a
    client error)."""

    token_id: int
    logprob: TokenLogprob | None = None
    error: str | None = None
    error_code: str | None = None
