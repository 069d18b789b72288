"""Self-speculative drafting (LayerSkip's early exit, transformers' ``assistant_early_exit``): the target's
own first ``num_layers`` layers, its final norm and its head draft the next tokens, one decode row per
sequence per draft position, reading and writing the target's own pages of those layers. No second model, no second
cache: the verify chunk then recomputes every layer at those positions.

Each draft is the early exit's argmax (a point mass, which the verifier's rule needs: verifier.py). A
sequence stops drafting at its draft length, or when the early exit's probability of its draft falls
below its ``confidence_threshold`` (transformers' ``assistant_confidence_threshold``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from engine.generation.speculation import Speculation
from kvcache.manager import KVCacheManager
from scheduler.request import Request


@runtime_checkable
class Drafter(Protocol):
    def draft(
        self, token_ids: list[int], positions: list[int], block_tables: list[list[int]], num_layers: int
    ) -> torch.Tensor:
        """Logits ``[len(token_ids), vocab]`` of the first ``num_layers`` layers (engine/executor/runner.py)."""
        ...


class EarlyExitProposer:
    """Drafts for many sequences at once through ``runner.draft``: batched per draft position and per
    exit layer (each request's ``Speculation.num_layers``)."""

    def __init__(self, runner: Drafter, kv_manager: KVCacheManager) -> None:
        self.runner = runner
        self.kv_manager = kv_manager

    def propose(self, wanted: Sequence[tuple[Request, int, Speculation]]) -> dict[str, list[int]]:
        """Up to ``n`` drafts for each (decoding request, n, its speculation), by request id; a request
        whose draft positions cannot get blocks (or whose fork copy is pending) drafts nothing."""
        drafts: dict[str, list[int]] = {}
        for num_layers in sorted({spec.num_layers or 0 for _, _, spec in wanted}):
            group = [(r, n, s) for r, n, s in wanted if (s.num_layers or 0) == num_layers]
            drafts.update(self._draft(group, num_layers))
        return drafts

    def _draft(
        self, wanted: Sequence[tuple[Request, int, Speculation]], num_layers: int
    ) -> dict[str, list[int]]:
        active = [item for item in wanted if self._make_room(item[0], item[1])]
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _, _ in active}
        step = 0
        while active:
            logits = self.runner.draft(
                [drafts[r.request_id][-1] if step else r.all_token_ids[-1] for r, _, _ in active],
                [r.num_computed_tokens + step for r, _, _ in active],
                [self.kv_manager.block_table(r.request_id) for r, _, _ in active],
                num_layers,
            )  # [len(active), vocab]
            confidence, tokens = torch.softmax(logits, dim=-1).max(dim=-1)
            still = []
            for (req, n, spec), token, p in zip(active, tokens.tolist(), confidence.tolist(), strict=True):
                if p < spec.confidence_threshold:
                    continue
                drafts[req.request_id].append(int(token))
                if len(drafts[req.request_id]) < n:
                    still.append((req, n, spec))
            active = still
            step += 1
        return drafts

    def _make_room(self, req: Request, n: int) -> bool:
        """Blocks for the draft positions (the last known token's and the n - 1 drafts' after it)."""
        rid = req.request_id
        if self.kv_manager.has_pending_copy(rid):
            return False
        num_tokens = req.num_computed_tokens + n
        if not self.kv_manager.can_allocate_slots(rid, num_tokens):
            return False
        self.kv_manager.allocate_slots(rid, num_tokens)
        return True
