"""Beam search inside the continuous batch: a ``BeamSearchGroup`` is a sequence group whose running beams
are scheduler requests decoding beside every other request, and ``BeamSteps`` scores a step's beams.

A group's beams are scored together (engine/generation/beam_search.py) in a step where every running beam
has its logits; in a step where one has not (it was preempted, or waits for its first block), the beams
that have theirs take no token and compute their last token again next step (``Scheduler.update``). The
beams of a group form one scheduler gang, preempted together.

After the scores, the beams are reordered in the scheduler: the first new beam that continues an old one
takes its place (its token is appended as any sampled token is); another new beam continuing the same old
one becomes a fork of it (``Scheduler.fork``: the full KV blocks shared, the partial one copied on write);
an old beam that no new beam continues is finished and its blocks freed. When the search is over every
beam is finished and the ``num_return_sequences`` best hypotheses are published, best first, as the
group's outputs ``0..n-1``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from engine.generation.beam_search import BeamChoice, BeamSearch, Hypothesis
from engine.generation.config import GenerationConfig
from engine.generation.constrained_beam_search import ConstrainedBeamSearch
from engine.generation.diverse_beam_search import DiverseBeamSearch
from engine.generation.processors import apply_logits_processors
from engine.generation.rows import SampledToken, SamplingRow
from engine.generation.stopping import StoppingCriteria
from engine.output_processor import Failure, OutputProcessor
from engine.sequence_group import Sequence, SequenceGroup
from scheduler.base import Scheduler
from scheduler.batch import ScheduledBatch
from scheduler.request import FinishReason, Request


def new_search(
    config: GenerationConfig, max_new_tokens: int, stop_token_ids: Collection[int], prompt_ids: list[int]
) -> BeamSearch | DiverseBeamSearch | ConstrainedBeamSearch:
    """The request's search: diverse with ``num_beam_groups`` > 1, constrained with constraints; beam
    sampling seeded with ``seed``."""
    top_logprobs = config.top_logprobs if config.output_logprobs else 0
    constraints = config.all_constraints
    if constraints:
        return ConstrainedBeamSearch(
            config.num_beams,
            constraints,
            prompt_ids,
            max_new_tokens,
            stop_token_ids,
            config.num_return_sequences,
            config.length_penalty,
            config.early_stopping,
            top_logprobs,
        )
    if config.num_beam_groups > 1:
        return DiverseBeamSearch(
            config.num_beams,
            config.num_beam_groups,
            config.diversity_penalty,
            max_new_tokens,
            stop_token_ids,
            config.length_penalty,
            config.early_stopping,
            top_logprobs,
        )
    generator = None
    if not config.is_greedy:
        generator = torch.Generator()
        if config.seed is None:
            generator.seed()
        else:
            generator.manual_seed(config.seed)
    return BeamSearch(
        config.num_beams,
        max_new_tokens,
        stop_token_ids,
        config.length_penalty,
        config.early_stopping,
        do_sample=not config.is_greedy,
        top_logprobs=top_logprobs,
        generator=generator,
    )


@dataclass(eq=False)
class ForkingGroup(SequenceGroup):
    """A group whose running sequences ("beams") are scheduler requests of one gang that publish nothing of
    their own: after a step that scores them all, the group continues some, forks others and prunes the
    rest (``reorder``, ``pruned``, then ``move_in_scheduler``). A beam search's beams; contrastive search's
    candidates (engine/contrastive_group.py)."""

    # running beam i's sequence
    beams: list[Sequence] = field(default_factory=list)
    num_started: int = 0  # beam sequences created: scheduler ids "{request_id}#{k}"

    def sampling(self, seq: Sequence) -> list[Sequence]:
        return []  # beams are scored by their group, not sampled

    def unforked_siblings(self, failed: Sequence) -> list[Sequence]:
        return []

    def searching(self) -> list[Sequence]:
        return list(dict.fromkeys(b for b in self.beams if not b.finished))

    def new_request(self, seq: Sequence, output_ids: list[int] | None = None) -> Request:
        request = super().new_request(seq, output_ids)
        request.gang = self.request_id
        return request

    def reorder(
        self, choices: list[BeamChoice]
    ) -> tuple[dict[str, list[int]], list[tuple[Sequence, Sequence]]]:
        """The new running beams from ``choices``: the tokens appended to continued beams (scheduler id ->
        token) and the forks to make after the scheduler took them (parent, child: its request made)."""
        old = self.beams
        new_tokens: dict[str, list[int]] = {}
        forks: list[tuple[Sequence, Sequence]] = []
        beams: list[Sequence] = []
        for choice in choices:
            parent = old[choice.parent]
            if parent.scheduler_id not in new_tokens:
                new_tokens[parent.scheduler_id] = [choice.token_id]
                beams.append(parent)
                continue
            child = self._new_beam()
            assert parent.request is not None
            tokens = [*parent.request.output_ids, choice.token_id]
            child.request = self.new_request(child, output_ids=tokens)
            forks.append((parent, child))
            beams.append(child)
        self.beams = beams
        return new_tokens, forks

    def pruned(self, old: list[Sequence]) -> list[Sequence]:
        """The beams of ``old`` that no running beam continues."""
        kept = set(self.beams)
        return [b for b in dict.fromkeys(old) if b not in kept]

    def _new_beam(self) -> Sequence:
        seq = Sequence(self, self.num_started, self._generation_state(self.num_started))
        self.num_started += 1
        return seq


def move_in_scheduler(
    scheduler: Scheduler, forks: list[tuple[Sequence, Sequence]], pruned: list[Sequence]
) -> None:
    """Make a group's forks (after the scheduler took the step's tokens), then finish its pruned beams."""
    for parent, child in forks:
        assert child.request is not None
        child.request = scheduler.fork(parent.scheduler_id, child.request)
    for beam in pruned:
        beam.finished = True
        scheduler.finish_request(beam.scheduler_id, FinishReason.ABORT)


@dataclass(eq=False)
class BeamSearchGroup(ForkingGroup):
    """One request searched with ``config.num_beams`` beams; its outputs are the best hypotheses."""

    def __post_init__(self) -> None:
        super().__post_init__()
        cfg = self.config
        criteria = StoppingCriteria(cfg, self.eos_token_ids, self.max_new_tokens)
        self.row_eos = criteria.eos_token_ids
        self.search = new_search(cfg, self.max_new_tokens, criteria.stop_token_ids, self.prompt_ids)

    def start(self) -> Sequence:
        seq = self._new_beam()
        self.beams = [seq] * self.config.num_beams  # before the first step: sequence 0, num_beams times
        return seq

    # ------------------------------------------------------------------ one step
    def score(
        self, logits: torch.Tensor, rows: dict[Sequence, int], vocab_size: int, default_eos: tuple[int, ...]
    ) -> list[BeamChoice]:
        """One search step over the beams' logits (``rows``: beam -> its row of ``logits``). Raises
        ``ValueError`` for NaN or infinite logits."""
        index = torch.tensor([rows[b] for b in self.beams], dtype=torch.int64, device=logits.device)
        raw = logits.index_select(0, index)[:, :vocab_size].float()  # [num_beams, V]
        sums = raw.sum(dim=1)
        if bool((torch.isnan(sums) | (sums == float("inf"))).any()):
            raise ValueError("the model produced NaN or infinite logits for this sequence")
        log_probs = torch.log_softmax(raw, dim=-1)
        sampling_rows = [
            SamplingRow(self.config, self.prompt_ids, beam.token_ids, eos_token_ids=self.row_eos)
            for beam in self.search.running
        ]
        apply_logits_processors(log_probs, sampling_rows, default_eos)
        return self.search.step(log_probs.cpu())

    def results(self) -> list[tuple[Sequence, Hypothesis]]:
        """The group's outputs once the search is over: sequence ``i`` for the ``i``-th best hypothesis."""
        outputs = []
        for i, hyp in enumerate(self.search.best(self.n)):
            seq = Sequence(self, i, self._generation_state(i), score=hyp.score)
            self.sequences.append(seq)
            outputs.append((seq, hyp))
        return outputs


@dataclass
class BeamSteps:
    """A step's beam searches: each group whose running beams all have their logits this step is scored
    (``search``, with the forward's rows), then reordered in the scheduler (``apply``, after its update)."""

    rows: dict[BeamSearchGroup, dict[Sequence, int]]  # group -> beam -> its row among the sampling rows
    new_tokens: dict[str, list[int]] = field(default_factory=dict)  # scheduler id -> [token], for update()
    failed: list[Failure] = field(default_factory=list)
    _moves: list[tuple[BeamSearchGroup, list[Sequence], list[tuple[Sequence, Sequence]]]] = field(
        default_factory=list
    )

    @classmethod
    def of(cls, batch: ScheduledBatch) -> BeamSteps:
        rows: dict[BeamSearchGroup, dict[Sequence, int]] = {}
        for li, chunk in enumerate(chunk for chunk in batch.requests if chunk.needs_sample):
            seq: Sequence = chunk.request.payload
            if isinstance(seq.group, BeamSearchGroup):
                rows.setdefault(seq.group, {})[seq] = li
        return cls(rows)

    def search(self, logits: torch.Tensor, vocab_size: int, default_eos: tuple[int, ...]) -> None:
        """Score every group whose beams all have a row of ``logits`` (one per chunk that samples)."""
        for group, rows in self.rows.items():
            if not all(beam in rows for beam in group.searching()):
                continue  # NOTE: a beam is missing (preempted, or waiting): the group waits for it
            try:
                choices = group.score(logits, rows, vocab_size, default_eos)
            except ValueError as exc:
                self.failed.append(Failure(group.beams[0], str(exc)))
                continue
            old = group.beams
            if group.search.done:
                self._moves.append((group, list(dict.fromkeys(old)), []))
                continue
            new_tokens, forks = group.reorder(choices)
            self.new_tokens.update(new_tokens)
            self._moves.append((group, group.pruned(old), forks))

    def apply(self, scheduler: Scheduler) -> list[BeamSearchGroup]:
        """Make the forks, finish the pruned beams; returns the groups whose search is over (every beam
        finished), whose results are to be published."""
        done: list[BeamSearchGroup] = []
        for group, pruned, forks in self._moves:
            move_in_scheduler(scheduler, forks, pruned)
            if group.search.done:
                done.append(group)
        return done


def publish_results(group: BeamSearchGroup, outputs: OutputProcessor, now: float) -> None:
    """Publish the group's best hypotheses, each fed token by token to its own output sequence (stopping,
    detokenizing, log-probabilities when asked for), as a sample's tokens are."""
    keep_logprobs = group.config.output_logprobs
    for seq, hyp in group.results():
        reason: FinishReason | Failure | None = None
        for token, logprob in zip(hyp.token_ids, hyp.logprobs, strict=True):
            reason = outputs.accept(seq, SampledToken(token, logprob if keep_logprobs else None), now)
            if isinstance(reason, Failure):
                outputs.fail(seq, reason.error, reason.code)
                break
        if not isinstance(reason, Failure):
            seq.finished = True
            outputs.publish(seq, finish_reason=reason or FinishReason.LENGTH)
