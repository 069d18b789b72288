"""What ranks 1..N-1 of a tensor-parallel model do: wait for rank 0's message, act on it, until ``Stop``.
Every ``RunStep`` runs the same forward as rank 0's (engine/executor/parallel/runner.py), over this rank's
heads' KV pages; the logits it ends with are rank 0's business and dropped here."""

from __future__ import annotations

import logging

import torch

from engine.executor.attention.backend import select_decode_kernel
from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.kv_cache import KVCache
from engine.executor.parallel.messages import AllocateCache, Heartbeat, RunStep, Stop, inputs_on
from engine.executor.parallel.sharded_llama import ShardedLlamaForCausalLM
from engine.executor.parallel.sharded_transformers import ShardedTransformersForCausalLM

logger = logging.getLogger(__name__)


class RankLoop:
    """One non-zero rank's state: its shard, its KV cache and decode kernel (once rank 0 sized them)."""

    def __init__(self, model: ShardedLlamaForCausalLM | ShardedTransformersForCausalLM) -> None:
        self.model = model
        self.group = model.group
        self.kv_cache: KVCache | None = None
        self.decode_kernel: DecodeKernel | None = None

    def run(self) -> None:
        """Serve rank 0's messages until ``Stop``. Raises when a message cannot be received (rank 0 died,
        or sent nothing, not even a heartbeat, for the idle timeout) or a step fails."""
        while True:
            message = self.group.receive()
            if isinstance(message, Stop):
                return
            if isinstance(message, RunStep):
                self.step(message)
            elif isinstance(message, AllocateCache):
                self.allocate(message)
            elif not isinstance(message, Heartbeat):
                raise TypeError(f"rank {self.group.rank}: unexpected message {message!r}")

    def allocate(self, message: AllocateCache) -> None:
        cfg, model = self.model.config, self.model
        self.kv_cache = None  # NOTE: the old pages go before the new ones are allocated
        self.kv_cache = KVCache(
            cfg.num_hidden_layers,
            message.num_blocks,
            message.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            model.dtype,
            model.device,
        )
        self.decode_kernel = select_decode_kernel(
            message.attention_backend,
            model.device,
            model.dtype,
            cfg.head_dim,
            message.block_size,
            cfg.num_queries_per_kv,
        )

    @torch.inference_mode()
    def step(self, message: RunStep) -> None:
        if self.kv_cache is None:
            raise RuntimeError(f"rank {self.group.rank}: a step before the KV cache was allocated")
        if message.blocks_to_copy:
            self.kv_cache.copy_blocks(message.blocks_to_copy)
        inputs = inputs_on(message.inputs, self.model.device)
        if message.num_layers is None:
            self.model(inputs, self.kv_cache, self.decode_kernel)
        else:  # NOTE: a self-speculative draft: the native model's early exit
            self.model(inputs, self.kv_cache, self.decode_kernel, num_layers=message.num_layers)
