"""Rank 0's executor of a tensor-parallel model: each step's ``BatchInputs`` (and block copies) is
broadcast once to the other ranks (engine/executor/parallel/rank_loop.py), then every rank runs the same
forward over its shard and its heads' KV pages; rank 0 returns the gathered logits.

Any failure of a step is fatal (``ExecutorFailedError``): a rank that died, hung past the collectives'
timeout or raised leaves the others out of step. The CPU decode stack and CUDA graphs do not run here:
the C stack has no collectives between its layers, and a graph would have to capture them. Self-speculative
drafts (the first layers only) are broadcast the same way; a draft model runs on rank 0 alone.
"""

from __future__ import annotations

import torch

from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.draft_model import DraftModel
from engine.executor.kv_cache import KVCache
from engine.executor.parallel.cores import bind_to_rank_cores
from engine.executor.parallel.messages import AllocateCache, RunStep, inputs_on
from engine.executor.parallel.sharded_llama import ShardedLlamaForCausalLM
from engine.executor.parallel.sharded_transformers import ShardedTransformersForCausalLM
from engine.executor.parallel.workers import ShardWorkers
from engine.executor.runner import ModelRunner
from scheduler.batch import ScheduledBatch

HOST = torch.device("cpu")


class TensorParallelRunner(ModelRunner):
    def __init__(
        self,
        model: ShardedLlamaForCausalLM | ShardedTransformersForCausalLM,
        kv_cache: KVCache,
        block_size: int,
        device: torch.device,
        decode_kernel: DecodeKernel | None = None,
        draft_model: DraftModel | None = None,
    ) -> None:
        super().__init__(model, kv_cache, block_size, device, decode_kernel, draft_model=draft_model)
        if model.workers is None:
            raise ValueError("TensorParallelRunner needs rank 0's model, the one holding the other ranks")
        self.workers: ShardWorkers = model.workers
        self.world_size = model.group.world_size
        backend = decode_kernel.name if decode_kernel is not None else "sdpa"
        self.workers.allocate_cache(AllocateCache(kv_cache.num_blocks, block_size, backend))
        self._bound = False  # the engine thread binds itself to rank 0's cores at its first step

    def check_alive(self) -> None:
        """``ExecutorFailedError`` once a rank died or the ranks fell out of step."""
        self.workers.check_alive()

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        self.check_alive()
        if not self._bound:
            bind_to_rank_cores(0, self.workers.local_world_size)
            self._bound = True
        try:
            inputs = self.prepare(batch)
            self.workers.send(RunStep(inputs_on(inputs, HOST), list(batch.blocks_to_copy)))
            if batch.blocks_to_copy:
                self.kv_cache.copy_blocks(batch.blocks_to_copy)
            logits = self.model(inputs, self.kv_cache, self.decode_kernel)  # [num_logits, vocab]
        except Exception as exc:
            raise self.workers.step_failed(exc) from exc
        if self.draft_model is not None:  # NOTE: a whole model of its own, on rank 0 only
            self.draft_model.follow(inputs, list(batch.blocks_to_copy))
        return logits.float()

    @torch.inference_mode()
    def draft(
        self, token_ids: list[int], positions: list[int], block_tables: list[list[int]], num_layers: int
    ) -> torch.Tensor:
        """Self-speculative drafting through the first ``num_layers`` layers, on every rank."""
        self.check_alive()
        try:
            inputs = self.draft_inputs(token_ids, positions, block_tables)
            self.workers.send(RunStep(inputs_on(inputs, HOST), [], num_layers))
            logits = self.model(inputs, self.kv_cache, self.decode_kernel, num_layers=num_layers)
        except Exception as exc:
            raise self.workers.step_failed(exc) from exc
        return logits.float()
