"""Log-probabilities reported to the client: ``log_softmax`` of the PROCESSED logits (after penalties,
biases and warpers, as OpenAI reports them), the chosen token's and the top-N alternatives'."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.outputs import TokenLogprob


def compute_logprobs(
    processed: torch.Tensor, chosen: Sequence[int], top_n: Sequence[int]
) -> list[TokenLogprob]:
    """One ``TokenLogprob`` per row of ``processed`` [R, V]: ``chosen[r]``'s log-probability and the
    ``top_n[r]`` most likely tokens, best first. Alternatives a warper removed (log-probability -inf)
    are left out: they could not have been chosen, and -inf is not valid JSON."""
    if processed.shape[0] != len(chosen) or len(chosen) != len(top_n):
        raise ValueError("processed rows, chosen tokens and top_n must have one entry per row")
    if not chosen:
        return []
    logp = torch.log_softmax(processed.float(), dim=-1)  # [R, V]
    chosen_t = torch.tensor(list(chosen), dtype=torch.int64, device=logp.device).unsqueeze(1)  # [R, 1]
    chosen_lp = logp.gather(1, chosen_t).squeeze(1).tolist()  # [R]
    max_n = max(top_n)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_n > 0:
        vals, ids = torch.topk(logp, min(max_n, logp.shape[1]), dim=-1)  # [R, max_n]
        top_vals, top_ids = vals.tolist(), ids.tolist()
    out: list[TokenLogprob] = []
    for r, token in enumerate(chosen):
        top: list[tuple[int, float]] = []
        if top_n[r] > 0:
            top = [
                (t, v)
                for t, v in zip(top_ids[r][: top_n[r]], top_vals[r][: top_n[r]], strict=True)
                if v != float("-inf")
            ]
        out.append(TokenLogprob(token_id=int(token), logprob=float(chosen_lp[r]), top=top))
    return out
