"""A separate draft model (vLLM's ``draft_model`` method, transformers' ``assistant_model``): a smaller model
with the target's vocabulary, its own paged KV cache indexed by the target's block tables.

The draft model runs every batch the target runs (prefill chunks, decode rows, verify chunks: ``follow``),
so its pages hold the K/V of every position the target has computed, prefix-cache hits and forks included
(a fork's copy-on-write copies its pages too). Drafting (``draft``) then runs it one decode row per
drafting sequence per position, as the early exit does (engine/speculative/early_exit.py's proposer drives
both).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.decode_stack import CpuDecodeStack
from engine.executor.inputs import BatchInputs
from engine.executor.kv_cache import KVCache


class DraftModel:
    """The draft model, its KV cache and its decode fast path (the float32 CPU decode stack, if it has one)."""

    def __init__(self, model: nn.Module, kv_cache: KVCache, decode_kernel: DecodeKernel | None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.decode_kernel = decode_kernel
        self.decode_stack = CpuDecodeStack.for_model(model)

    @torch.inference_mode()
    def follow(self, inputs: BatchInputs, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Compute the K/V of the target's batch (its logits are not needed)."""
        if blocks_to_copy:
            self.kv_cache.copy_blocks(blocks_to_copy)
        self.forward(inputs)

    @torch.inference_mode()
    def draft(
        self, token_ids: list[int], positions: list[int], block_tables: list[list[int]], num_layers: int
    ) -> torch.Tensor:
        """The ``Drafter`` call (engine/speculative/early_exit.py): one token per sequence at its position; ``num_layers`` is
        the early exit's and does not apply. Logits ``[len(token_ids), vocab]`` (float32)."""
        inputs = BatchInputs.build(
            [[t] for t in token_ids], positions, block_tables, [1] * len(token_ids), self.kv_cache.block_size,
            device=self.kv_cache.device,
        )  # fmt: skip
        return self.forward(inputs).float()

    def forward(self, inputs: BatchInputs) -> torch.Tensor:
        if self.decode_stack is not None and self.decode_stack.can_run(inputs, self.decode_kernel):
            return self.decode_stack.run(inputs, self.kv_cache)
        return self.model(inputs, self.kv_cache, self.decode_kernel)
