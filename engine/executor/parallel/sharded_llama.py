"""One rank's shard of a Llama-family model: ``LlamaForCausalLM`` over the rank's heads, intermediate rows
and vocabulary rows (engine/executor/parallel/sharding.py), with the collectives that make its output the
whole model's:

    h = all_reduce(embed_rows(ids))                    vocabulary-parallel embedding (other rows are 0)
    for each layer:
        attn = all_reduce(o_proj_cols(attn(q/k/v rows)))   column-parallel q/k/v, row-parallel o_proj
        mlp = all_reduce(down_cols(silu(gate) * up))       column-parallel gate/up, row-parallel down
    logits = all_gather(lm_head_rows(norm(h)))[:, :vocab]

Every rank runs this same forward over its own heads' KV pages; each ends with the whole logits.
The layers' code is Llama's: the collectives arrive as module swaps after loading (``shard``), around
plain ``Linear`` modules that the CPU fast paths then swap as in one process (engine/executor/fast_paths.py;
the C decode stack does not run: it has no collectives between its layers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.executor.models.layers import Linear
from engine.executor.models.llama import DecoderLayer, LlamaForCausalLM
from engine.executor.parallel.group import ShardGroup
from engine.executor.parallel.sharding import shard_config, vocab_per_rank
from engine.model_config import ModelConfig

if TYPE_CHECKING:
    from engine.executor.parallel.workers import ShardWorkers


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x W_r^T) + b``: the rank holds the columns of ``W`` its input shard meets; the
    bias is added once, after the sum. ``local`` is a bias-free ``Linear`` (the CPU fast paths swap it
    like any other)."""

    def __init__(self, inner: Linear, group: ShardGroup) -> None:
        super().__init__()
        weight = inner.weight
        self.local = Linear(inner.in_features, inner.out_features, False, weight.dtype, weight.device, weight)
        self.bias, self.group = inner.bias, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self.local(x))  # [num_tokens, out_features]
        return y if self.bias is None else y + self.bias


class VocabParallelHead(nn.Module):
    """The output head over the rank's vocabulary rows (``local``), the ranks' logits gathered side by
    side and cut back to the model's vocabulary."""

    def __init__(self, inner: Linear, group: ShardGroup, vocab_size: int) -> None:
        super().__init__()
        self.local, self.group, self.vocab_size = inner, group, vocab_size

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = self.local(h)  # [rows, vocab / world_size]
        return self.group.all_gather_columns(local)[:, : self.vocab_size]  # [rows, vocab]


class ShardedLlamaForCausalLM(LlamaForCausalLM):
    """Rank ``group.rank``'s shard of the model ``full_config`` describes. ``config`` is the shard's
    (its heads, KV heads, rows); ``full_config`` the whole model's. Load with ``load_weights`` on
    ``shard_weights(...)``, then call ``shard()``. On rank 0, ``workers`` are the other ranks' processes."""

    # NOTE: a CUDA graph would have to capture the collectives too; every step runs eagerly.
    supports_cuda_graphs = False

    def __init__(
        self, full_config: ModelConfig, group: ShardGroup, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__(shard_config(full_config, group.world_size), dtype, device)
        self.full_config = full_config
        self.group = group
        self.vocab_start = group.rank * vocab_per_rank(full_config.vocab_size, group.world_size)
        self.workers: ShardWorkers | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.config.vocab_size
        local = input_ids - self.vocab_start  # [num_tokens]
        outside = (local < 0) | (local >= rows)
        x = F.embedding(local.masked_fill(outside, 0), self.model.embed_tokens)  # [num_tokens, hidden]
        x = self.group.all_reduce(x.masked_fill(outside[:, None], 0.0))
        multiplier = self.config.embedding_multiplier  # Granite's
        return x if multiplier == 1.0 else x * multiplier

    def shard(self) -> None:
        """Swap in the collectives (after ``load_weights``, which cannot run afterwards)."""
        rows: list[tuple[nn.Module, str]] = []
        for module in self.model.layers:
            layer = cast(DecoderLayer, module)
            rows += [(layer.self_attn, "o_proj"), (layer.mlp, "down_proj")]
        for parent, name in rows:
            setattr(parent, name, RowParallelLinear(_linear(getattr(parent, name)), self.group))
        head = VocabParallelHead(_linear(self.lm_head), self.group, self.full_config.vocab_size)
        self.add_module("lm_head", head)

    def close(self) -> None:
        """Rank 0: stop the other ranks' processes (idempotent)."""
        if self.workers is not None:
            self.workers.close()


def _linear(module: nn.Module) -> Linear:
    if not isinstance(module, Linear):
        raise RuntimeError(f"shard() expects the dense Linear, found {type(module).__name__}")
    return module
