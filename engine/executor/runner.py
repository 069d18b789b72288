"""Turns a ScheduledBatch into the model's inputs and runs one batched forward."""

from __future__ import annotations

from typing import Protocol, cast

import torch

from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.cuda_graphs import CudaGraphDecoder
from engine.executor.decode_stack import CpuDecodeStack
from engine.executor.draft_model import DraftModel
from engine.executor.inputs import BatchInputs
from engine.executor.kv_cache import KVCache
from scheduler.batch import ScheduledBatch


class GivesHiddenStates(Protocol):
    """A model whose ``supports_hidden_states`` is true (engine/executor/models/llama.py)."""

    def forward_with_hidden(
        self, inputs: BatchInputs, kv_cache: KVCache, decode_kernel: DecodeKernel | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class ModelRunner:
    """Owns the model and its KV cache tensors; called only from the engine thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        block_size: int,
        device: torch.device,
        decode_kernel: DecodeKernel | None = None,
        cuda_graphs: CudaGraphDecoder | None = None,
        decode_stack: CpuDecodeStack | None = None,
        draft_model: DraftModel | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.decode_kernel = decode_kernel  # None: decode attention in SDPA
        self.cuda_graphs = cuda_graphs  # None: every step runs eagerly
        self.decode_stack = decode_stack  # None: CPU decode steps run layer by layer
        self.draft_model = draft_model  # speculative decoding's draft model: it follows every batch
        self._hidden: torch.Tensor | None = None  # the last execute's hidden rows (contrastive search)

    def prepare(self, batch: ScheduledBatch) -> BatchInputs:
        """The batch's inputs. A verify chunk (a last token and its drafts) enters as one decode row per
        token over the same pages, each attending to the positions up to its own: every row's K/V is
        written before any row attends, so this is the chunk's causal attention, and the step stays a
        decode step for the decode kernels (the CPU decode stack, CUDA graphs)."""
        token_ids: list[list[int]] = []
        starts: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        exits: list[tuple[int, ...]] = []
        hidden_rows: list[int] = []
        for s in batch.requests:
            if s.draft_ids:
                token_ids.extend([t] for t in s.token_ids)
                starts.extend(range(s.start, s.end))
                tables.extend([s.block_ids] * s.num_tokens)
                logits_rows.extend([1] * s.num_tokens)
                exits.extend([()] * s.num_tokens)
                hidden_rows.extend([0] * s.num_tokens)
                continue
            token_ids.append(s.token_ids)
            starts.append(s.start)
            tables.append(s.block_ids)
            logits_rows.append(s.num_logits_rows)
            exits.append(s.request.exit_layers if s.needs_sample else ())
            hidden_rows.append(s.num_hidden_rows)
        return BatchInputs.build(
            token_ids=token_ids,
            starts=starts,
            block_tables=tables,
            logits_rows=logits_rows,
            block_size=self.block_size,
            device=self.device,
            exit_layers=exits,
            hidden_rows=hidden_rows,
        )

    def draft_inputs(
        self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]
    ) -> BatchInputs:
        """A drafting step's inputs: one decode row per sequence."""
        return BatchInputs.build(
            token_ids=[[t] for t in token_ids],
            starts=positions,
            block_tables=block_tables,
            logits_rows=[1] * len(token_ids),
            block_size=self.block_size,
            device=self.device,
        )

    @torch.inference_mode()
    def draft(
        self, token_ids: list[int], positions: list[int], block_tables: list[list[int]], num_layers: int
    ) -> torch.Tensor:
        """Self-speculative drafting: one token per sequence at its position through the model's first
        ``num_layers`` layers, then the final norm and the head (their K/V written to those layers' pages).
        Logits ``[len(token_ids), vocab]`` (float32)."""
        inputs = self.draft_inputs(token_ids, positions, block_tables)
        if self.decode_stack is not None and self.decode_stack.can_run(inputs, self.decode_kernel):
            return self.decode_stack.run(inputs, self.kv_cache, num_layers)
        return self.model(inputs, self.kv_cache, self.decode_kernel, num_layers=num_layers).float()

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Run one batch through the model: logits ``[sum of num_logits_rows, vocab]`` (float32), each
        chunk's ``num_logits_rows`` last rows in batch order (the last one samples when ``needs_sample``);
        the draft model, if any, computes the batch's K/V in its own pages too."""
        self._hidden = None
        logits = self._execute(batch)
        if self.draft_model is not None:
            self.draft_model.follow(self.prepare(batch), batch.blocks_to_copy)
        return logits

    def _execute(self, batch: ScheduledBatch) -> torch.Tensor:
        if batch.blocks_to_copy:
            self.kv_cache.copy_blocks(batch.blocks_to_copy)
        # layer by layer: the layers' outputs are read (DoLa's early exits, contrastive search's hidden rows)
        layer_by_layer = any(s.request.exit_layers or s.num_hidden_rows for s in batch.requests)
        if self.cuda_graphs is not None and not layer_by_layer and self.cuda_graphs.can_run(batch):
            logits = self.cuda_graphs.run(batch)  # [len(batch), vocab], one row per sequence
            if all(s.num_logits_rows for s in batch.requests):
                return logits
            rows = [i for i, s in enumerate(batch.requests) if s.num_logits_rows]
            return logits[torch.tensor(rows, device=logits.device)]
        inputs = self.prepare(batch)
        if (
            self.decode_stack is not None
            and not layer_by_layer
            and self.decode_stack.can_run(inputs, self.decode_kernel)
        ):
            return self.decode_stack.run(inputs, self.kv_cache)  # [num_sampled, vocab]
        if inputs.hidden_indices is not None:
            model = cast(GivesHiddenStates, self.model)
            logits, self._hidden = model.forward_with_hidden(inputs, self.kv_cache, self.decode_kernel)
            return logits.float()
        logits = self.model(inputs, self.kv_cache, self.decode_kernel)  # [num_sampled, vocab]
        return logits.float()

    @property
    def supports_hidden_states(self) -> bool:
        """Whether the model gives its rows' final hidden states (``take_hidden_states``)."""
        return bool(getattr(self.model, "supports_hidden_states", False))

    def take_hidden_states(self) -> torch.Tensor:
        """The final norm's output of the last ``execute``'s rows that asked for it: each chunk's
        ``num_hidden_rows`` last rows, in batch order, ``[sum of num_hidden_rows, hidden]`` (the model's
        dtype). Only models with ``supports_hidden_states`` give them."""
        if self._hidden is None:
            raise RuntimeError("the last batch asked for no hidden states")
        hidden, self._hidden = self._hidden, None
        return hidden
