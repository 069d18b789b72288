"""A prompt token's rank as vLLM counts it: every token at least as likely, itself included (ties share the
larger rank)."""

from __future__ import annotations

import torch

from engine.generation.prompt_logprobs import prompt_token_logprobs


def test_tied_tokens_share_the_larger_rank_as_vllm_counts() -> None:
    """vLLM's rank is ``(logprobs >= token_logprob).sum()`` (vllm/v1/sample/ops/logprobs.py
    ``batched_count_greater_than``): tokens as likely as the prompt token rank before it. Main counts only
    the strictly more likely ones (rank 1 here, vLLM says 5). Ties are rare with real logits; exact ones
    happen (tokens with equal output embeddings, e.g. unused or padded vocabulary rows)."""
    got = prompt_token_logprobs(torch.zeros(1, 5), [3], top_n=0)
    assert got[0].rank == 5
