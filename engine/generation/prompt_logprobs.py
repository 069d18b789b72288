"""Prompt log-probabilities (vLLM's ``prompt_logprobs``, OpenAI completions' ``echo`` with ``logprobs``):
how likely the model found each prompt token given the tokens before it.

The logits at prompt position ``i`` predict token ``i + 1``. They are the model's raw logits (no processor
applies to a prompt), log-softmaxed in float32. A request that asks for them computes every prompt position
(the scheduler reads no prefix cache for it) and they arrive chunk by chunk under chunked prefill;
``PromptLogprobs`` collects them for the request's group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.outputs import TokenLogprob


def prompt_token_logprobs(logits: torch.Tensor, targets: Sequence[int], top_n: int) -> list[TokenLogprob]:
    """One ``TokenLogprob`` per row of ``logits`` [R, V]: the log-probability and rank of ``targets[r]``
    (the next prompt token) and the ``top_n`` most likely tokens at that position, best first."""
    if logits.shape[0] != len(targets):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(targets)} target tokens")
    if not targets:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    target = torch.tensor(list(targets), dtype=torch.int64, device=logp.device).unsqueeze(1)  # [R, 1]
    target_lp = logp.gather(1, target)  # [R, 1]
    ranks = (logp >= target_lp).sum(dim=-1)  # [R]: vLLM's rank, every token at least as likely counted
    top_vals: list[list[float]] = [[] for _ in targets]
    top_ids: list[list[int]] = [[] for _ in targets]
    if top_n > 0:
        vals, ids = torch.topk(logp, min(top_n, logp.shape[1]), dim=-1)  # [R, top_n]
        top_vals, top_ids = vals.tolist(), ids.tolist()
    return [
        TokenLogprob(
            token_id=int(t),
            logprob=float(lp),
            top=list(zip(top_ids[r], top_vals[r], strict=True)),
            rank=int(rk),
        )
        for r, (t, lp, rk) in enumerate(
            zip(targets, target_lp.squeeze(1).tolist(), ranks.tolist(), strict=True)
        )
    ]


class PromptLogprobs:
    """A request's prompt log-probabilities as its prefill chunks arrive: ``entries[0]`` is None (the
    first token has no context), then one per prompt token."""

    def __init__(self, prompt_ids: Sequence[int], top_n: int) -> None:
        self.prompt_ids = prompt_ids
        self.top_n = top_n
        self.entries: list[TokenLogprob | None] = [None]
        self.failed = False  # a prompt row's logits were NaN or infinite: the request must fail

    @property
    def is_complete(self) -> bool:
        return len(self.entries) >= len(self.prompt_ids)

    def add_chunk(self, start: int, logits: torch.Tensor) -> None:
        """The logits of prompt positions ``start .. start + len(logits) - 1`` (each predicting the next
        prompt token). Positions already recorded are skipped."""
        end = min(start + logits.shape[0], len(self.prompt_ids) - 1)
        first = len(self.entries) - 1  # the next position still missing
        if end <= first or start > first:
            return
        rows = logits[first - start : end - start]
        if self.failed or not bool(torch.isfinite(rows).all()):
            self.failed = True  # NOTE: no entry is added past a bad row: the list never completes
            return
        self.entries.extend(prompt_token_logprobs(rows, self.prompt_ids[first + 1 : end + 1], self.top_n))
