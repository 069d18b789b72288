"""One request's sequences: a ``SequenceGroup`` owns the ``Sequence``s that share its prompt.

Today a group holds ``n`` samples (``num_return_sequences``): sequence 0 alone prefills the prompt, and its
first sampling step fans out to ``n`` rows of the same logits; sequences 1..n-1 are then forked from it in
the scheduler (sharing its KV blocks). Beams and speculative drafts are meant to become new behaviours of
this class (which sequences sample, which are pruned, when the group is done), not branches in the loop.

Lifecycle of a sequence: created (sequence 0 on admission, the others at the fan-out or when the group is
cancelled or fails before it), running while it holds a scheduler ``Request``, ``finished`` once its final
output is published. The group is done when all ``n`` final outputs are.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from engine.generation.config import GenerationConfig
from engine.generation.detokenizer import TokenDecoder
from engine.generation.grammar import CompiledGrammar, GrammarMatcher
from engine.generation.prompt_logprobs import PromptLogprobs
from engine.generation.request_state import RequestGenerationState
from engine.generation.rows import SampledToken
from engine.generation.speculation import DraftLength, Speculation
from engine.generation.user_processors import RequestHooks
from engine.request_handle import Sink
from scheduler.request import FinishReason, Request


@dataclass(eq=False)
class SequenceGroup:
    """One submitted request: ``n`` samples of one prompt, and where their outputs go."""

    request_id: str
    prompt_ids: list[int]
    config: GenerationConfig
    max_new_tokens: int
    sink: Sink
    streaming: bool  # every step's output is published, not only the final one
    record_timestamps: bool
    tokenizer: TokenDecoder
    eos_token_ids: Seq[int]
    arrival_time: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)
    num_finished: int = 0  # final outputs published
    forked: bool = False  # the fan-out has happened (or can no longer happen)
    grammar: CompiledGrammar | None = None  # what every sample's output must match (compiled at admission)
    prompt_logprobs: PromptLogprobs | None = None  # set in __post_init__ when the config asks for them
    hooks: RequestHooks | None = None  # the request's own processors and stopping criteria (Python API)
    exit_layers: tuple[int, ...] = ()  # DoLa's candidate layers for this model (resolved at admission)
    speculation: Speculation | None = None  # how its samples draft tokens (resolved at admission)

    def __post_init__(self) -> None:
        if self.config.prompt_logprobs is not None:
            self.prompt_logprobs = PromptLogprobs(self.prompt_ids, self.config.prompt_logprobs)

    @property
    def n(self) -> int:
        return self.config.num_return_sequences

    def start(self) -> Sequence:
        """Create sequence 0, the one that prefills the prompt (on admission)."""
        matcher = self.grammar.matcher(self.max_new_tokens) if self.grammar is not None else None
        seq = Sequence(self, 0, self._generation_state(0, matcher))
        self.sequences.insert(0, seq)
        return seq

    def sampling(self, seq: Sequence) -> list[Sequence]:
        """The sequences that sample from ``seq``'s logits row this step: ``seq``, and at its first sample
        its ``n - 1`` siblings too (the fan-out)."""
        if self.n > 1 and not self.forked and seq.index == 0:
            return [seq, *self.siblings()]
        return [seq]

    def fan_out(self, tokens: list[SampledToken]) -> list[tuple[Sequence, SampledToken]]:
        """Pair sequence 0's siblings with the tokens they sampled at its first step (``tokens[1:]`` of
        its fan-out); they are forked from it once the scheduler has taken its token."""
        self.forked = True
        return list(zip(self.siblings(), tokens[1:], strict=True))

    def siblings(self) -> list[Sequence]:
        """Sequences 1..n-1, created on first use."""
        children = self.sequences[1:]
        if not children:
            children = [
                Sequence(self, i, self._generation_state(i, self._fork_matcher())) for i in range(1, self.n)
            ]
            self.sequences.extend(children)
        return children

    def unforked_siblings(self, failed: Sequence) -> list[Sequence]:
        """The siblings that fail with ``failed``: those of a sequence 0 that fails before its fan-out
        (they never got a token of their own)."""
        if failed.index != 0 or self.forked or self.n == 1:
            return []
        self.forked = True
        return [s for s in self.siblings() if not s.finished]

    def never_started(self) -> list[Sequence]:
        """Samples never forked (the group ended before the fan-out): each still owes a final output."""
        missing = [
            Sequence(self, i, self._generation_state(i), finished=True)
            for i in range(len(self.sequences), self.n)
        ]
        self.sequences.extend(missing)
        return missing

    def searching(self) -> list[Sequence]:
        """The sequences that hold scheduler requests but publish no output of their own: a beam
        search's running beams (engine/beam_group.py); none for samples."""
        return []

    def on_final_output(self) -> bool:
        """Count one sequence's final output; True once the whole group is done."""
        self.num_finished += 1
        return self.num_finished >= self.n

    def new_request(self, seq: Sequence, output_ids: list[int] | None = None) -> Request:
        """The scheduler's view of ``seq`` (``output_ids``: the tokens a fork starts with)."""
        return Request(
            request_id=seq.scheduler_id,
            prompt_ids=self.prompt_ids,
            max_new_tokens=self.max_new_tokens,
            arrival_time=self.arrival_time,
            output_ids=output_ids if output_ids is not None else [],
            wants_prompt_logits=self.prompt_logprobs is not None and not self.prompt_logprobs.is_complete,
            exit_layers=self.exit_layers,
            payload=seq,
        )

    def add_prompt_logits(self, request: Request, start: int, logits: torch.Tensor) -> None:
        """The logits of ``request``'s prompt positions from ``start`` (a prefill chunk's rows); once the
        whole prompt is in, the request stops asking for them."""
        if self.prompt_logprobs is None:
            return
        self.prompt_logprobs.add_chunk(start, logits)
        if self.prompt_logprobs.is_complete:
            request.wants_prompt_logits = False

    def _fork_matcher(self) -> GrammarMatcher | None:
        """A sibling's matcher: a copy of sequence 0's (which has not sampled yet at the fan-out)."""
        if self.grammar is None:
            return None
        parent = self.sequences[0].gen.grammar if self.sequences else None
        # NOTE: sequence 0 drops its matcher when it finishes; its siblings then fail or never start.
        return parent.copy() if parent is not None else self.grammar.matcher(self.max_new_tokens)

    def _generation_state(self, index: int, grammar: GrammarMatcher | None = None) -> RequestGenerationState:
        return RequestGenerationState(
            self.config,
            self.prompt_ids,
            self.tokenizer,
            self.eos_token_ids,
            sample_index=index,
            max_new_tokens=self.max_new_tokens,
            start_time=self.arrival_time,
            grammar=grammar,
            hooks=self.hooks,
        )


@dataclass(eq=False)
class Sequence:
    """One sample of a group: the engine's payload on a scheduler ``Request``."""

    group: SequenceGroup
    index: int
    gen: RequestGenerationState
    request: Request | None = None
    timestamps: list[float] = field(default_factory=list)
    pending_text: str = ""  # text not yet published
    pending_reason: FinishReason | None = None  # a forking parent's finish, applied after its forks
    sent_ids: int = 0  # generated ids already published
    sent_logprobs: int = 0
    finished: bool = False
    draft_length: DraftLength | None = None  # speculative decoding: drafts per step (set at its first)
    score: float | None = None  # a beam search's returned hypothesis: its score

    @property
    def scheduler_id(self) -> str:
        return f"{self.group.request_id}#{self.index}"
