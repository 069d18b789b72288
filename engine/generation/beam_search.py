"""Beam search's scoring for one request, step by step, as transformers 5.x ``_beam_search`` computes it
(one batch row of it: the same tensor ops, so the same ties break the same way).

Each step takes the running beams' processed log-probabilities ``[num_beams, V]`` (``log_softmax`` of the
logits, then the logits processors, as transformers orders them) and:

1. adds each beam's running score and keeps the best ``K = max(2, 1 + #EOS) * num_beams`` continuations of
   all beams (``do_sample``: draws ``K`` of them without replacement from the softmax of those scores);
2. marks the continuations that end (an EOS / stop token, or ``max_new_tokens`` reached);
3. keeps the ``num_beams`` best that do not end as the next running beams;
4. offers the ending ones among the first ``num_beams`` to the finished hypotheses, scored
   ``sum_logprobs / length ** length_penalty``, keeping the ``num_beams`` best;
5. decides whether the search is over: ``early_stopping=True`` once ``num_beams`` hypotheses are finished;
   ``False`` once no running beam can beat the worst finished one at its current length (a heuristic);
   ``"never"`` once none can at ``max_new_tokens`` (with a positive ``length_penalty``); always once every
   continuation ends.

The first step starts from one sequence (the prompt) as ``num_beams`` copies whose scores are
``[0, -1e9, ...]``, so only the first copy's continuations count, as in transformers. Pure tensors: the
engine maps the choices onto its sequences (engine/beam_group.py).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from engine.outputs import TokenLogprob

NEG = -1.0e9  # transformers' "very large negative" score


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its generated tokens, their processed log-probabilities and its score."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
    score: float


@dataclass(frozen=True)
class BeamChoice:
    """A running beam of the next step: running beam ``parent`` of this step extended by ``token_id``."""

    parent: int
    token_id: int


@dataclass
class Beam:
    """A running beam: its generated tokens and their processed log-probabilities."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


def extend_beam(beam: Beam, row: torch.Tensor, token: int, top_logprobs: int) -> Beam:
    """``beam`` extended by ``token``, whose processed log-probability ``row[token]`` is kept (with the
    ``top_logprobs`` best of ``row``)."""
    top: list[tuple[int, float]] = []
    if top_logprobs:
        values, ids = torch.topk(row, top_logprobs)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return Beam([*beam.token_ids, token], [*beam.logprobs, TokenLogprob(token, float(row[token]), top)])


class BeamSearch:
    """One request's beam search state. ``step(log_probs)`` once per generated position until ``done``;
    then ``best(n)``.

    ``stop_token_ids``: the tokens that end a beam (EOS and stop tokens); ``top_logprobs``: alternatives
    recorded with each token's log-probability; ``generator``: the draws of beam sampling."""

    def __init__(
        self,
        num_beams: int,
        max_new_tokens: int,
        stop_token_ids: Collection[int],
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        do_sample: bool = False,
        top_logprobs: int = 0,
        generator: torch.Generator | None = None,
    ) -> None:
        if num_beams < 1 or max_new_tokens < 1:
            raise ValueError(f"num_beams ({num_beams}) and max_new_tokens ({max_new_tokens}) must be >= 1")
        self.num_beams = num_beams
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.do_sample = do_sample
        self.top_logprobs = top_logprobs
        self.generator = generator
        self.num_candidates = max(2, 1 + len(self.stop_token_ids)) * num_beams  # K
        self.num_generated = 0
        self.done = False
        self.running = [Beam() for _ in range(num_beams)]
        self.running_scores = torch.zeros(num_beams)  # [num_beams]
        self.running_scores[1:] = NEG
        self.finished: list[Hypothesis | None] = [None] * num_beams
        self.finished_scores = torch.full((num_beams,), NEG)  # [num_beams]
        self.is_finished = torch.zeros(num_beams, dtype=torch.bool)  # [num_beams]
        self.improvable = torch.ones((1, 1), dtype=torch.bool)  # the early-stop heuristic is unsatisfied

    # ------------------------------------------------------------------ one step
    def step(self, log_probs: torch.Tensor) -> list[BeamChoice]:
        """Score ``log_probs [num_beams, V]`` (row ``i``: running beam ``i``'s processed log-probabilities);
        returns the next running beams, best first (empty once ``done``)."""
        if self.done:
            raise RuntimeError("the beam search is over")
        num_beams, vocab = log_probs.shape
        if num_beams != self.num_beams:
            raise ValueError(f"expected {self.num_beams} rows of log-probabilities, got {num_beams}")
        accumulated = (log_probs.float() + self.running_scores[:, None]).reshape(1, -1)  # [1, num_beams * V]
        scores, flat = self._top_candidates(accumulated)  # [1, K] each
        parents = (flat // vocab)[0].tolist()
        tokens = (flat % vocab)[0].tolist()
        new_len = self.num_generated + 1
        ends = torch.tensor(
            [[t in self.stop_token_ids or new_len >= self.max_new_tokens for t in tokens]]
        )  # [1, K]
        candidates = [
            extend_beam(self.running[p], log_probs[p], t, self.top_logprobs)
            for p, t in zip(parents, tokens, strict=True)
        ]

        running_scores = scores + ends.to(torch.float32) * NEG
        next_idx = torch.topk(running_scores, k=self.num_beams)[1][0]  # [num_beams]
        self._offer_finished(scores, ends, candidates, new_len)

        self.num_generated = new_len
        self.running_scores = running_scores[0, next_idx]
        self.running = [candidates[i] for i in next_idx.tolist()]
        self._check_early_stop()
        self.done = not self._has_unfinished(ends)
        if self.done:
            return []
        return [BeamChoice(parents[i], tokens[i]) for i in next_idx.tolist()]

    def best(self, n: int) -> list[Hypothesis]:
        """The ``n`` best finished hypotheses, best first."""
        chosen = [h for h in self.finished[:n] if h is not None]
        if len(chosen) < n:
            raise RuntimeError(f"the beam search finished {len(chosen)} hypotheses, {n} were asked for")
        return chosen

    # ------------------------------------------------------------------ its parts
    def _top_candidates(self, accumulated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' ``_get_top_k_continuations``: scores and flat indices of the K continuations."""
        k = self.num_candidates
        if not self.do_sample:
            values, indices = torch.topk(accumulated, k=k)
            return values, indices
        probs = torch.nn.functional.softmax(accumulated, dim=-1)
        indices = torch.multinomial(probs, num_samples=k, generator=self.generator)
        values = torch.gather(accumulated, dim=1, index=indices)
        values, order = values.sort(dim=-1, descending=True)
        return values, indices.gather(dim=-1, index=order)

    def _offer_finished(
        self, scores: torch.Tensor, ends: torch.Tensor, candidates: list[Beam], new_len: int
    ) -> None:
        """transformers' ``_update_finished_beams``."""
        top_mask = torch.zeros(self.num_candidates, dtype=torch.bool)
        top_mask[: self.num_beams] = True
        just_finished = ends & top_mask[None, :]  # [1, K]
        offered = scores / (new_len**self.length_penalty)
        full = torch.all(self.is_finished) & (self.early_stopping is True)
        offered = offered + full.to(torch.float32) * NEG
        offered = offered + (~self.improvable).to(torch.float32) * NEG
        offered = offered + (~just_finished) * NEG
        merged_scores = torch.cat((self.finished_scores[None, :], offered), dim=1)  # [1, num_beams + K]
        merged_finished = torch.cat((self.is_finished[None, :], just_finished), dim=1)
        keep = torch.topk(merged_scores, k=self.num_beams)[1][0].tolist()
        offered_hyps = [
            Hypothesis(c.token_ids, c.logprobs, float(s))
            for c, s in zip(candidates, offered[0].tolist(), strict=True)
        ]
        merged = [*self.finished, *offered_hyps]
        self.finished = [merged[i] for i in keep]
        self.finished_scores = merged_scores[0, keep]
        self.is_finished = merged_finished[0, keep]

    def _check_early_stop(self) -> None:
        """transformers' ``_check_early_stop_heuristic``, after the step (``cur_len`` grown by one)."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = self.num_generated
        best_running = self.running_scores[None, :1] / (best_length**self.length_penalty)  # [1, 1]
        worst_finished = torch.where(
            self.is_finished[None, :], torch.min(self.finished_scores[None, :], dim=1, keepdim=True)[0], NEG
        )  # [1, num_beams]
        self.improvable = self.improvable & torch.any(best_running > worst_finished, dim=-1, keepdim=True)

    def _has_unfinished(self, ends: torch.Tensor) -> bool:
        """transformers' ``_beam_search_has_unfinished_sequences``."""
        improvement_possible = bool(torch.any(self.improvable))
        open_beam = not (bool(torch.all(self.is_finished)) and self.early_stopping is True)
        valid_continuations = not bool(torch.all(ends))
        return improvement_possible and open_beam and valid_continuations
