"""The finished hypotheses of a beam search (one group of it), as transformers 4.x ``BeamHypotheses``
keeps them: at most ``num_beams``, in the order kept, the lowest score dropped when one more comes; and
its ``is_done`` (the group beam search and the constrained beam search score with it)."""

from __future__ import annotations

from engine.generation.beam_search import Beam, Hypothesis


class BeamHypotheses:
    def __init__(
        self, num_beams: int, length_penalty: float, early_stopping: bool | str, max_new_tokens: int
    ) -> None:
        self.num_beams = num_beams
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_new_tokens = max_new_tokens
        self.hypotheses: list[Hypothesis] = []
        self.worst_score = 1e9

    def __len__(self) -> int:
        return len(self.hypotheses)

    def add(self, beam: Beam, sum_logprobs: float, length: int) -> None:
        """Offer ``beam`` (``length`` tokens, log-probabilities summing to ``sum_logprobs``)."""
        score = sum_logprobs / (length**self.length_penalty)
        if len(self) < self.num_beams or score > self.worst_score:
            self.hypotheses.append(Hypothesis(beam.token_ids, beam.logprobs, score))
            if len(self) > self.num_beams:
                ranked = sorted((h.score, i) for i, h in enumerate(self.hypotheses))
                del self.hypotheses[ranked[0][1]]
                self.worst_score = ranked[1][0]
            else:
                self.worst_score = min(score, self.worst_score)

    def is_done(self, best_sum_logprobs: float, length: int) -> bool:
        """Whether no running beam can improve on the hypotheses (``early_stopping``: True, at once once
        full; False, by the best beam at the current length; "never", at ``max_new_tokens`` with a positive
        ``length_penalty``)."""
        if len(self) < self.num_beams:
            return False
        if self.early_stopping is True:
            return True
        best_length = length
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_new_tokens
        return self.worst_score >= best_sum_logprobs / best_length**self.length_penalty
