"""DoLa, decoding by contrasting layers (Chuang et al., "DoLa: Decoding by Contrasting Layers Improves
Factuality in Large Language Models", 2023), as transformers 4.x's ``_dola_decoding`` defines it for one
sequence (transformers 5.x moved it to its hub; the seeds, 002, "DoLa Decoding", keep it):

    premature logits  p_l = lm_head(h_l)                h_l: the residual stream entering layer l (no final norm)
    premature layer   l* = argmax over candidates l of JSD(softmax(final), softmax(p_l))
    contrast          log_softmax(final) - log_softmax(p_l*), over the tokens whose final log-probability is
                      within log(relative_top) of the best (others -inf in the final, -1e-3 in the base)

The contrast replaces a row's logits before any processor, as transformers applies its ``logits_processor``
to DoLa's output. Candidate layers: ``"low"``, ``"high"`` or a list (``candidate_layers``). The model
computes ``p_l`` only for the rows that ask (engine/executor/models/llama.py, ``BatchInputs.early_exits``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

RELATIVE_TOP = 0.1
BASE_FILTER_VALUE = -1e-3


@dataclass(frozen=True)
class LayerContrast:
    """What a model offers DoLa: its layer count and whether its output head is its embedding."""

    num_layers: int
    tie_word_embeddings: bool

    def candidate_layers(self, dola_layers: str | list[int]) -> tuple[int, ...]:
        """transformers' choice: the embedding output (layer 0) is skipped when the head is tied to it (the
        early exit would be the identity); for N <= 40 layers ``"low"`` is every second layer of the first
        half and ``"high"`` of the second half; for deeper models, of the first and last 20. A list keeps
        its layers below N. ``ValueError`` when none is left."""
        n = self.num_layers
        start = 0 if not self.tie_word_embeddings else 2 if n > 2 else 1 if n == 2 else 0
        if dola_layers == "low":
            if start == n // 2:
                layers = [start]
            else:
                layers = list(range(start, n // 2, 2)) if n <= 40 else list(range(start, 20, 2))
        elif dola_layers == "high":
            layers = list(range(n // 2, n, 2)) if n <= 40 else list(range(n - 20, n, 2))
        elif isinstance(dola_layers, list):
            layers = [i for i in dola_layers if i < n]
        else:
            raise ValueError(
                f"dola_layers must be 'low', 'high' or a list of layer indices, got {dola_layers!r}"
            )
        if not layers:
            raise ValueError(f"dola_layers {dola_layers!r} leaves no layer below this model's {n}")
        return tuple(layers)


def contrast(final: torch.Tensor, premature: torch.Tensor) -> torch.Tensor:
    """One row's DoLa logits: ``final`` ``[vocab]`` against the candidate layers' ``premature``
    ``[num_layers, vocab]`` logits (float32)."""
    final, premature = final.float(), premature.float()
    if premature.shape[0] == 1:
        base = premature[0]
    else:
        mean = 0.5 * (F.softmax(final, dim=-1)[None, :] + F.softmax(premature, dim=-1))  # [layers, vocab]
        log_final = F.log_softmax(final, dim=-1)  # [vocab]
        log_premature = F.log_softmax(premature, dim=-1)  # [layers, vocab]
        kl_final = F.kl_div(log_final[None, :], mean, reduction="none").mean(-1)  # [layers]
        kl_premature = F.kl_div(log_premature, mean, reduction="none").mean(-1)  # [layers]
        js = 0.5 * (kl_final + kl_premature)
        base = premature[int(js.argmax())]
    return _relative_top_contrast(final, base)


def _relative_top_contrast(final: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    final_log = final.log_softmax(dim=-1)
    base_log = base.log_softmax(dim=-1)
    threshold = final_log.max() + math.log(RELATIVE_TOP)  # never above the best token's log-probability
    below = final_log < threshold
    final_log = final_log.masked_fill(below, -float("inf"))
    base_log = base_log.masked_fill(below, BASE_FILTER_VALUE)
    return final_log - base_log
