"""Constrained beam search for one request, step by step, as transformers 4.x
``_constrained_beam_search`` and its ``ConstrainedBeamSearchScorer`` define it (the seeds' "Constraints";
``force_words_ids``; engine/generation/constraints.py).

Each step scores like beam search (the best ``max(2, 1 + #EOS) * num_beams`` continuations of the running
beams' accumulated log-probabilities; an EOS among the first ``num_beams`` ends a hypothesis, but only
one whose sequence, prompt included, fulfils every constraint). Then the candidates are widened with, for
every running beam whose constraints are not all met, each token that makes progress on them (a token not
otherwise among the candidates), and ranked by their ``bank`` (constraint tokens fulfilled) first: the best
of the highest bank, then the best of the next bank, ..., round-robin over the banks (Lu et al.'s "banks",
https://hf.co/papers/2010.12884, as transformers' ``step_sentence_constraint`` orders them), the first
``num_beams`` running on. At ``max_new_tokens`` the running beams that fulfil the constraints become
hypotheses; when fewer than asked do, the others too (the search could not satisfy them).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from engine.generation.beam_hypotheses import BeamHypotheses
from engine.generation.beam_search import NEG, Beam, BeamChoice, Hypothesis, extend_beam
from engine.generation.constraints import Constraint, ConstraintListState


class ConstrainedBeamSearch:
    """``step(log_probs [num_beams, V])`` once per position until ``done``; then ``best(n)``."""

    def __init__(
        self,
        num_beams: int,
        constraints: Sequence[Constraint],
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Collection[int],
        num_return_sequences: int = 1,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        top_logprobs: int = 0,
    ) -> None:
        self.num_beams = num_beams
        self.constraints = list(constraints)
        self.prompt_ids = list(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.num_return_sequences = num_return_sequences
        self.top_logprobs = top_logprobs
        self.num_candidates = max(2, 1 + len(self.stop_token_ids)) * num_beams
        self.hypotheses = BeamHypotheses(num_beams, length_penalty, early_stopping, max_new_tokens)
        self.num_generated = 0
        self.done = False
        self.running = [Beam() for _ in range(num_beams)]
        self.running_scores = torch.zeros(num_beams)
        self.running_scores[1:] = NEG
        # NOTE: each running beam's progress through the constraints, prompt included (kept, not recomputed)
        prompt_state = ConstraintListState.of(self.constraints, self.prompt_ids)
        self.states = [prompt_state.copy() for _ in range(num_beams)]

    def best(self, n: int) -> list[Hypothesis]:
        ranked = sorted(self.hypotheses.hypotheses, key=lambda h: h.score)
        if len(ranked) < n:
            raise RuntimeError(f"the beam search finished {len(ranked)} hypotheses, {n} were asked for")
        return [ranked.pop() for _ in range(n)]

    def _state_after(self, parent: int, token: int) -> ConstraintListState:
        """Running beam ``parent``'s progress once ``token`` follows it."""
        state = self.states[parent].copy()
        state.add(token)
        return state

    # ------------------------------------------------------------------ one step
    def step(self, log_probs: torch.Tensor) -> list[BeamChoice]:
        if self.done:
            raise RuntimeError("the beam search is over")
        vocab = log_probs.shape[1]
        new_len = self.num_generated + 1
        accumulated = log_probs.float() + self.running_scores[:, None]  # [num_beams, V]
        values, indices = torch.topk(
            accumulated.view(1, -1), self.num_candidates, dim=1, largest=True, sorted=True
        )
        candidates: list[tuple[float, int, int]] = []  # (score, parent, token)
        for rank, (value, index) in enumerate(zip(values[0].tolist(), indices[0].tolist(), strict=True)):
            parent, token = divmod(index, vocab)
            if token in self.stop_token_ids:
                if rank < self.num_beams and self.states[parent].completed:
                    beam = extend_beam(self.running[parent], log_probs[parent], token, self.top_logprobs)
                    self.hypotheses.add(beam, value, new_len)
            else:
                candidates.append((value, parent, token))
            if len(candidates) == self.num_beams:
                break
        chosen = self._rank_by_bank(candidates, accumulated)
        done = self.hypotheses.is_done(float(values[0, 0]), new_len)
        self.num_generated = new_len
        self.running = [
            extend_beam(self.running[p], log_probs[p], t, self.top_logprobs) for _, p, t in chosen
        ]
        self.states = [self._state_after(p, t) for _, p, t in chosen]
        self.running_scores = torch.tensor([s for s, _, _ in chosen])
        if done or new_len >= self.max_new_tokens:
            self._finalize(done)
            return []
        return [BeamChoice(p, t) for _, p, t in chosen]

    def _rank_by_bank(
        self, candidates: list[tuple[float, int, int]], accumulated: torch.Tensor
    ) -> list[tuple[float, int, int]]:
        """transformers' ``step_sentence_constraint``: the candidates widened with the tokens that advance
        each beam's constraints, ordered round-robin over their banks, the first ``num_beams`` kept."""
        seen = [[*self.running[p].token_ids, t] for _, p, t in candidates]
        banks = [self._state_after(p, t).bank for _, p, t in candidates]
        widened = list(candidates)
        for parent, beam in enumerate(self.running):
            if self.states[parent].completed:
                continue
            for token in self.states[parent].advance():
                ids = [*beam.token_ids, token]
                if ids in seen:
                    continue
                seen.append(ids)
                banks.append(self._state_after(parent, token).bank)
                widened.append((float(accumulated[parent, token]), parent, token))
        scores = torch.tensor([s for s, _, _ in widened])
        all_banks = torch.tensor(banks)
        order = (all_banks * 100 + scores).sort(descending=True).indices
        sorted_banks = all_banks[order].tolist()
        increments: list[int] = []
        counter, current = -1, sorted_banks[0]
        for bank in sorted_banks:
            counter, current = (counter + 1, current) if bank == current else (0, bank)
            increments.append(counter)
        # NOTE: a stable sort by the rank within the bank (numpy's mergesort in transformers)
        rearranged = sorted(range(len(increments)), key=increments.__getitem__)
        order = order[torch.tensor(rearranged, dtype=torch.int64)][: self.num_beams]
        return [widened[i] for i in order.tolist()]

    def _finalize(self, done: bool) -> None:
        """transformers' ``finalize``: the running beams that fulfil the constraints become hypotheses; if
        fewer than asked for do, the others too."""
        self.done = True
        if done:
            return
        beams = list(zip(self.running, self.running_scores.tolist(), strict=True))
        fulfils = [state.completed for state in self.states]
        for (beam, score), ok in zip(beams, fulfils, strict=True):
            if ok:
                self.hypotheses.add(beam, score, self.num_generated)
        if sum(fulfils) < self.num_return_sequences:
            for (beam, score), ok in zip(beams, fulfils, strict=True):
                if not ok:
                    self.hypotheses.add(beam, score, self.num_generated)
