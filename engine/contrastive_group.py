"""Contrastive search inside the continuous batch: a ``ContrastiveGroup`` runs its ``top_k`` candidates as
``top_k`` forks of its sequence, rows of the same step as every other request, and ``ContrastiveSteps``
scores a step's groups (engine/generation/contrastive.py: the algorithm's scoring).

One cycle per generated token:

1. the sequence's next-token distribution (the prompt's last row at first, later the chosen candidate's
   row) goes through the logits processors (greedy ones: no warper) and gives the ``top_k`` candidates;
2. the group's running sequence continues with the first candidate and is forked once per other candidate
   (``ForkingGroup.reorder``, ``Scheduler.fork``: the full KV blocks shared, the partial one copied on
   write), so the next step computes every candidate as a decode row, each giving its logits and its final
   hidden state (``Request.wants_hidden``);
3. the candidate with the best contrastive score against the sequence's earlier hidden states is chosen:
   its token is the output's next token (stopping, detokenizing and publishing as for a sample), its hidden
   state joins the context, its fork goes on and the others are finished with their blocks freed.

The prompt's hidden states come from its own forward (``Request.wants_prompt_hidden``: its chunks compute
every position, no prefix-cache hit). The context, ``[len(prompt) + max_new_tokens, hidden]`` in the
model's dtype, is allocated once per request and lives with the group. The forks form one scheduler gang,
preempted together; a step in which some fork has no row (preempted, or waiting) scores nothing, and the
forks that had one compute their candidate again next step, as beams do (engine/beam_group.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.beam_group import ForkingGroup, move_in_scheduler
from engine.generation.beam_search import BeamChoice
from engine.generation.contrastive import Candidates, choose, top_candidates
from engine.generation.processors import apply_logits_processors
from engine.generation.rows import SampledToken
from engine.generation.sampler import Sampler
from engine.output_processor import Failure, OutputProcessor
from engine.sequence_group import Sequence
from scheduler.base import Scheduler
from scheduler.batch import ScheduledBatch
from scheduler.request import FinishReason, Request


@dataclass
class ContrastiveMove:
    """What one scored step does to a group: tokens appended to continued forks (scheduler id -> [token]),
    forks to make, forks to finish, and the output's finish reason when the chosen token ended it."""

    new_tokens: dict[str, list[int]]
    forks: list[tuple[Sequence, Sequence]]
    pruned: list[Sequence]
    committed: bool  # a token was added to the output (not at the prompt's step)
    finish_reason: FinishReason | None = None


@dataclass(eq=False)
class ContrastiveGroup(ForkingGroup):
    """One request decoded by contrastive search (``penalty_alpha`` > 0, ``top_k`` > 1). Its output is
    sequence 0 of ``sequences``, which holds no scheduler request: the running forks (``beams``) do."""

    context: torch.Tensor | None = None  # [len(prompt) + max_new_tokens, hidden], the first num_context set
    num_context: int = 0
    prompt_seen: bool = False  # every prompt position's hidden state is in the context
    candidates: Candidates | None = None  # beam i's last token is candidates.token_ids[i]

    @property
    def output(self) -> Sequence:
        return self.sequences[0]

    def start(self) -> Sequence:
        self.sequences.insert(0, Sequence(self, 0, self._generation_state(0)))
        seq = self._new_beam()
        self.beams = [seq]
        return seq

    def never_started(self) -> list[Sequence]:
        """The output when it has not published its final output yet (it has no request of its own)."""
        return [self.output] if self.sequences and not self.output.finished else []

    def new_request(self, seq: Sequence, output_ids: list[int] | None = None) -> Request:
        request = super().new_request(seq, output_ids)
        request.wants_hidden = True
        request.wants_prompt_hidden = not self.prompt_seen
        return request

    # ------------------------------------------------------------------ the forward's hidden states
    def add_prompt_hidden(self, request: Request, start: int, hidden: torch.Tensor) -> None:
        """The final hidden states of the prompt positions from ``start`` (a prefill chunk's rows); once the
        whole prompt is in, no request asks again."""
        if self.context is None:
            size = len(self.prompt_ids) + self.max_new_tokens
            self.context = hidden.new_empty(size, hidden.shape[-1])
        self.context[start : start + hidden.shape[0]] = hidden
        if start + hidden.shape[0] == len(self.prompt_ids):
            self.prompt_seen = True
            self.num_context = len(self.prompt_ids)
            request.wants_prompt_hidden = False

    # ------------------------------------------------------------------ one step
    def step(
        self,
        logits: torch.Tensor,
        hidden: torch.Tensor,
        rows: dict[Sequence, tuple[int, int]],
        vocab_size: int,
        default_eos: tuple[int, ...],
        outputs: OutputProcessor,
        now: float,
    ) -> ContrastiveMove | Failure:
        """Choose among the candidates (``rows``: fork -> its logits row and hidden row) and feed the chosen
        token to the output; then the next candidates from the chosen row. Raises ``ValueError`` for NaN
        or infinite logits."""
        assert self.context is not None
        old = self.beams
        chosen = 0  # the prompt's step: the one sequence's row
        committed = self.candidates is not None
        if self.candidates is not None:
            states = hidden[torch.tensor([rows[b][1] for b in old], device=hidden.device)]  # [k, H]
            context = self.context[: self.num_context]
            chosen = choose(self.candidates, context, states, float(self.config.penalty_alpha or 0.0))
            logprobs = self.candidates.logprobs
            token = SampledToken(self.candidates.token_ids[chosen], logprobs[chosen] if logprobs else None)
            reason = outputs.accept(self.output, token, now)
            if isinstance(reason, Failure):
                return Failure(old[0], reason.error, reason.code)  # NOTE: a fork, so that the search ends
            self.context[self.num_context] = states[chosen]
            self.num_context += 1
            if reason is not None:
                return ContrastiveMove({}, [], list(old), committed=True, finish_reason=reason)
        self.candidates = self._next_candidates(logits[rows[old[chosen]][0]], vocab_size, default_eos)
        new_tokens, forks = self.reorder([BeamChoice(chosen, t) for t in self.candidates.token_ids])
        return ContrastiveMove(new_tokens, forks, self.pruned(old), committed)

    def _next_candidates(
        self, row: torch.Tensor, vocab_size: int, default_eos: tuple[int, ...]
    ) -> Candidates:
        """The top-k of the processed distribution of the output's next token."""
        raw = row[:vocab_size].float().clone()
        total = raw.sum()
        if bool(torch.isnan(total) | (total == float("inf"))):
            raise ValueError("the model produced NaN or infinite logits for this sequence")
        processed = apply_logits_processors(raw[None], [self.output.gen.sampling_row()], default_eos)[0]
        cfg = self.config
        return top_candidates(processed, cfg.top_k, cfg.top_logprobs if cfg.output_logprobs else None)


@dataclass
class ContrastiveSteps:
    """A step's contrastive searches: their prompt chunks' hidden states, then each group whose forks all
    have their rows this step is scored (``search``), then reordered in the scheduler and its output
    published (``apply``, after the scheduler's update)."""

    # group -> fork -> (its row among the sampling rows, its row among the hidden rows)
    rows: dict[ContrastiveGroup, dict[Sequence, tuple[int, int]]]
    # (group, request, first position, its rows among the hidden rows) of each prompt chunk
    prompt_chunks: list[tuple[ContrastiveGroup, Request, int, slice]]
    num_hidden_rows: int
    new_tokens: dict[str, list[int]] = field(default_factory=dict)  # scheduler id -> [token], for update()
    failed: list[Failure] = field(default_factory=list)
    _moves: list[tuple[ContrastiveGroup, ContrastiveMove]] = field(default_factory=list)

    @classmethod
    def of(cls, batch: ScheduledBatch) -> ContrastiveSteps:
        rows: dict[ContrastiveGroup, dict[Sequence, tuple[int, int]]] = {}
        prompt_chunks: list[tuple[ContrastiveGroup, Request, int, slice]] = []
        sampling_row = hidden_row = 0
        for chunk in batch.requests:
            seq: Sequence = chunk.request.payload
            n = chunk.num_hidden_rows
            if isinstance(seq.group, ContrastiveGroup):
                if chunk.request.wants_prompt_hidden:
                    prompt_chunks.append(
                        (seq.group, chunk.request, chunk.start, slice(hidden_row, hidden_row + n))
                    )
                if chunk.needs_sample:
                    rows.setdefault(seq.group, {})[seq] = (sampling_row, hidden_row + n - 1)
            hidden_row += n
            sampling_row += chunk.needs_sample
        return cls(rows, prompt_chunks, hidden_row)

    def search(
        self,
        logits: torch.Tensor,
        hidden: torch.Tensor | None,
        sampler: Sampler,
        outputs: OutputProcessor,
        now: float,
    ) -> None:
        """Take the prompt chunks' hidden states, then score every group whose forks all have a row of
        ``logits`` (one per chunk that samples) and of ``hidden`` (``num_hidden_rows``, batch order); the
        chosen tokens go to their outputs (``outputs.accept``)."""
        if hidden is None:
            return
        vocab_size, default_eos = sampler.vocab_size, sampler.eos_token_ids
        for group, request, start, span in self.prompt_chunks:
            group.add_prompt_hidden(request, start, hidden[span])
        for group, rows in self.rows.items():
            if not all(beam in rows for beam in group.searching()):
                continue  # NOTE: a fork is missing (preempted, or waiting): the group waits for it
            try:
                move = group.step(logits, hidden, rows, vocab_size, default_eos, outputs, now)
            except ValueError as exc:
                self.failed.append(Failure(group.beams[0], str(exc)))
                continue
            if isinstance(move, Failure):
                self.failed.append(move)
                continue
            self.new_tokens.update(move.new_tokens)
            self._moves.append((group, move))

    def apply(self, scheduler: Scheduler, outputs: OutputProcessor) -> None:
        """Make the forks, finish the pruned ones, publish each output that took a token."""
        for group, move in self._moves:
            move_in_scheduler(scheduler, move.forks, move.pruned)
            if move.finish_reason is not None:
                group.output.finished = True
                outputs.publish(group.output, finish_reason=move.finish_reason)
            elif move.committed:
                outputs.publish(group.output)
