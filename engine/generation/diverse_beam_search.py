"""Diverse beam search (Vijayakumar et al., https://hf.co/papers/1610.02424) for one request, step by step,
as transformers 4.x ``_group_beam_search`` and its ``BeamSearchScorer`` define it (the seeds' "Diverse beam
search"; transformers 5.x moved it out of its core into a Hub recipe).

The ``num_beams`` beams are split into ``num_beam_groups`` groups of ``num_beams / num_beam_groups``. Each
step the groups are scored in order, each like a small beam search of its own (the first beam of each group
starts at score 0, the others at -1e9), after a Hamming diversity penalty: a group's log-probabilities lose
``diversity_penalty`` times the number of times each token was chosen by the earlier groups in this step.
Within a group, the best ``max(2, 1 + #EOS) * group_size`` continuations are walked best first: one that
ends on EOS (among the first ``group_size``) becomes a finished hypothesis scored
``sum_logprobs / length ** length_penalty`` (a group keeps its ``group_size`` best), the others fill the
group's running beams. A group is done once it holds ``group_size`` hypotheses and (``early_stopping``
True) at once, (False) when its best continuation cannot beat its worst hypothesis at the current length,
("never") at ``max_new_tokens`` with a positive ``length_penalty``. At ``max_new_tokens`` the running beams
of the groups not done are offered as hypotheses. The best hypotheses of all groups are returned.

NOTE: transformers keeps a done group's beams running on its pad token, which then counts in the later
groups' penalty; here a done group's beams are dropped and choose nothing.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from engine.generation.beam_hypotheses import BeamHypotheses
from engine.generation.beam_search import NEG, Beam, BeamChoice, Hypothesis, extend_beam


@dataclass
class _Group:
    """One group: its running beams and scores, and its finished hypotheses."""

    beams: list[Beam]
    scores: torch.Tensor  # [group_size]
    hypotheses: BeamHypotheses
    done: bool = False


class DiverseBeamSearch:
    """``step(log_probs)`` once per position (rows: ``running``, the beams of the groups not done) until
    ``done``; then ``best(n)``."""

    def __init__(
        self,
        num_beams: int,
        num_beam_groups: int,
        diversity_penalty: float,
        max_new_tokens: int,
        stop_token_ids: Collection[int],
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        top_logprobs: int = 0,
    ) -> None:
        if num_beam_groups < 1 or num_beams % num_beam_groups:
            raise ValueError(
                f"num_beams ({num_beams}) must be a multiple of num_beam_groups ({num_beam_groups})"
            )
        self.group_size = num_beams // num_beam_groups
        self.diversity_penalty = diversity_penalty
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.top_logprobs = top_logprobs
        self.num_candidates = max(2, 1 + len(self.stop_token_ids)) * self.group_size
        self.num_generated = 0
        self.done = False
        start = torch.full((self.group_size,), NEG)
        start[0] = 0.0
        self.groups = [
            _Group(
                [Beam() for _ in range(self.group_size)],
                start.clone(),
                BeamHypotheses(self.group_size, length_penalty, early_stopping, max_new_tokens),
            )
            for _ in range(num_beam_groups)
        ]

    @property
    def running(self) -> list[Beam]:
        return [beam for group in self.groups if not group.done for beam in group.beams]

    # ------------------------------------------------------------------ one step
    def step(self, log_probs: torch.Tensor) -> list[BeamChoice]:
        """Score ``log_probs [len(running), V]``; returns the next running beams (their ``parent`` an index
        into this step's ``running``), empty once ``done``."""
        if self.done:
            raise RuntimeError("the beam search is over")
        new_len = self.num_generated + 1
        chosen: list[int] = []  # this step's tokens of the groups scored so far
        choices: list[BeamChoice] = []
        offset = 0
        for group in self.groups:
            if group.done:
                continue
            rows = log_probs[offset : offset + self.group_size].float()
            if chosen:
                counts = torch.bincount(torch.tensor(chosen), minlength=rows.shape[1])
                rows = rows - self.diversity_penalty * counts
            picked = self._score_group(group, rows, new_len)
            chosen += [token for _, token in picked]
            if not group.done:  # NOTE: a group done at this step chose (counted above) but runs no further
                choices += [BeamChoice(offset + parent, token) for parent, token in picked]
            offset += self.group_size
        self.num_generated = new_len
        if new_len >= self.max_new_tokens or all(g.done for g in self.groups):
            self._finalize()
            return []
        return choices

    def best(self, n: int) -> list[Hypothesis]:
        """The ``n`` best hypotheses of all groups (transformers' ``finalize``: a stable sort by score, the
        last of equal scores first)."""
        ranked = sorted((h for g in self.groups for h in g.hypotheses.hypotheses), key=lambda h: h.score)
        if len(ranked) < n:
            raise RuntimeError(f"the beam search finished {len(ranked)} hypotheses, {n} were asked for")
        return [ranked.pop() for _ in range(n)]

    # ------------------------------------------------------------------ its parts
    def _score_group(self, group: _Group, rows: torch.Tensor, new_len: int) -> list[tuple[int, int]]:
        """transformers' ``BeamSearchScorer.process`` for one group: its new running beams (parent within
        the group, token)."""
        vocab = rows.shape[1]
        accumulated = (rows + group.scores[:, None]).view(1, -1)  # [1, group_size * V]
        values, indices = torch.topk(accumulated, self.num_candidates, dim=1, largest=True, sorted=True)
        beams: list[Beam] = []
        scores: list[float] = []
        picked: list[tuple[int, int]] = []
        for rank, (value, index) in enumerate(zip(values[0].tolist(), indices[0].tolist(), strict=True)):
            parent, token = divmod(index, vocab)
            beam = extend_beam(group.beams[parent], rows[parent], token, self.top_logprobs)
            if token in self.stop_token_ids:
                if rank < self.group_size:
                    group.hypotheses.add(beam, value, new_len)
            else:
                beams.append(beam)
                scores.append(value)
                picked.append((parent, token))
            if len(beams) == self.group_size:
                break
        group.done = group.done or group.hypotheses.is_done(float(values[0, 0]), new_len)
        group.beams = beams
        group.scores = torch.tensor(scores)
        return picked

    def _finalize(self) -> None:
        """transformers' ``finalize``: the running beams of the groups not done are offered too."""
        for group in self.groups:
            if group.done:
                continue
            for beam, score in zip(group.beams, group.scores.tolist(), strict=True):
                group.hypotheses.add(beam, score, self.num_generated)
        self.done = True
