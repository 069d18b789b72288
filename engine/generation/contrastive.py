"""Contrastive search's scoring (Su et al., "A Contrastive Framework for Neural Text Generation", 2022), as
transformers 4.x's ``_contrastive_search`` and ``_ranking_fast`` compute it for one sequence (transformers
5.x moved it to its hub; the seeds, 002 and 004, "Contrastive search", keep it):

    candidates    the ``top_k`` tokens v of p = softmax(processed next-token logits)
    choice        argmax over v of (1 - alpha) * p(v) - alpha * max_j cos(h_v, h_j)

where ``h_v`` is the final norm's output at candidate v (the candidate run as the next token) and ``h_j``
ranges over every earlier position of the sequence, prompt included: the degeneration penalty. Pure tensors:
engine/contrastive_group.py runs the candidates as rows of the continuous batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob


@dataclass(frozen=True)
class Candidates:
    """The next position's candidates, most likely first: their tokens, probabilities ``[k]`` and (when
    the request asks for log-probabilities) each one's ``TokenLogprob`` in the processed distribution."""

    token_ids: list[int]
    probs: torch.Tensor
    logprobs: list[TokenLogprob] | None = None


def top_candidates(processed: torch.Tensor, top_k: int, top_logprobs: int | None = None) -> Candidates:
    """The ``top_k`` candidates of one row of processed logits ``[V]`` (``top_logprobs``: None keeps no
    log-probabilities, else each candidate's with that many alternatives)."""
    probs = torch.softmax(processed.float(), dim=-1)
    top_probs, top_ids = torch.topk(probs, dim=-1, k=min(top_k, processed.shape[-1]))
    ids = top_ids.tolist()
    logprobs = None
    if top_logprobs is not None:
        log_probs = torch.log_softmax(processed.float(), dim=-1)
        alternatives: list[tuple[int, float]] = []
        if top_logprobs:
            values, alt_ids = torch.topk(log_probs, top_logprobs)
            alternatives = list(zip(alt_ids.tolist(), values.tolist(), strict=True))
        logprobs = [TokenLogprob(t, float(log_probs[t]), alternatives) for t in ids]
    return Candidates(ids, top_probs, logprobs)


def degeneration_penalty(context: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Per candidate, the largest cosine similarity between its hidden state (a row of ``hidden``
    ``[k, H]``) and the sequence's earlier ones (``context`` ``[S, H]``): ``[k]``."""
    norm_context = context / context.norm(dim=-1, keepdim=True)
    norm_hidden = hidden / hidden.norm(dim=-1, keepdim=True)
    cosine = norm_context @ norm_hidden.T  # [S, k]
    return cosine.max(dim=0).values


def contrastive_scores(
    probs: torch.Tensor, context: torch.Tensor, hidden: torch.Tensor, alpha: float
) -> torch.Tensor:
    """``(1 - alpha) * p(v) - alpha * penalty(v)`` for each candidate: ``[k]``."""
    return (1.0 - alpha) * probs - alpha * degeneration_penalty(context, hidden)


def choose(candidates: Candidates, context: torch.Tensor, hidden: torch.Tensor, alpha: float) -> int:
    """The index of the chosen candidate (the first of equal scores, as ``torch.max`` breaks ties)."""
    scores = contrastive_scores(candidates.probs.to(hidden.device), context, hidden, alpha)
    return int(scores.max(dim=-1).indices)
