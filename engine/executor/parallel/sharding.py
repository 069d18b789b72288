"""Megatron-style shards of a Llama-family model: which part of each checkpoint tensor a rank holds.

Rank ``r`` of ``N`` holds, for every layer, the query heads ``[r H/N, (r+1) H/N)`` and the KV heads
``[r K/N, (r+1) K/N)`` (rows of q/k/v: column-parallel; columns of o_proj: row-parallel), the intermediate
rows ``[r I/N, (r+1) I/N)`` of gate and up and those columns of down, and the vocabulary rows
``[r V', (r+1) V')`` of the embedding and the output head (``V' = ceil(V/N)``; the last rank's missing rows
are zeros, and the gathered logits are cut back to ``V``). Norms and o_proj's bias are whole on every rank.

Each checkpoint tensor is read whole, one at a time, and only the rank's slice is kept.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.model_config import ModelConfig


class ShardingError(ValueError):
    """The model cannot be cut into this many shards."""


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """Raise ``ShardingError`` unless ``world_size`` divides the query heads, the KV heads and the
    intermediate size, naming the numbers."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ShardingError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if heads % world_size or kv_heads % world_size or inter % world_size:
        sizes = [n for n in range(1, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0 and inter % n == 0]
        raise ShardingError(
            f"tensor_parallel_size {world_size} must divide the model's {heads} attention heads, its "
            f"{kv_heads} KV heads and its intermediate size {inter}; this model shards into "
            f"{', '.join(map(str, sizes))}"
        )


def vocab_per_rank(vocab_size: int, world_size: int) -> int:
    return -(-vocab_size // world_size)


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's model: its heads, KV heads, intermediate rows and vocabulary rows.
    (Special token ids are the whole model's business, above the shards.)"""
    check_shardable(config, world_size)
    return config.replace(
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=config.num_key_value_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
        vocab_size=vocab_per_rank(config.vocab_size, world_size),
        bos_token_id=None,
        eos_token_ids=(),
    )


def shard_weights(
    weights: Iterator[tuple[str, torch.Tensor]], config: ModelConfig, rank: int, world_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's ``(hf_name, tensor)`` pairs cut to rank ``rank``'s shards (a copy each, so that the
    whole tensor is freed)."""
    cut = _Cutter(config, rank, world_size)
    for name, tensor in weights:
        yield name, cut(name, tensor).contiguous()


class _Cutter:
    def __init__(self, config: ModelConfig, rank: int, world_size: int) -> None:
        self.config, self.rank, self.world_size = config, rank, world_size
        self.q = config.num_attention_heads * config.head_dim
        self.kv = config.num_key_value_heads * config.head_dim
        self.inter = config.intermediate_size

    def part(self, x: torch.Tensor, total: int, dim: int = 0) -> torch.Tensor:
        """Rank's ``1/N`` of ``x`` along ``dim`` (``total`` long there)."""
        size = total // self.world_size
        return x.narrow(dim, self.rank * size, size)

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self.vocab_rows(x)
        if leaf == "q_proj":
            return self.part(x, self.q)
        if leaf in ("k_proj", "v_proj"):
            return self.part(x, self.kv)
        if leaf == "qkv_proj":  # Phi-3: q, k, v rows in one tensor
            q, k, v = x.split([self.q, self.kv, self.kv])
            return torch.cat((self.part(q, self.q), self.part(k, self.kv), self.part(v, self.kv)))
        if leaf in ("gate_proj", "up_proj"):
            return self.part(x, self.inter)
        if leaf == "gate_up_proj":  # Phi-3: gate rows, then up rows
            gate, up = x.split([self.inter, self.inter])
            return torch.cat((self.part(gate, self.inter), self.part(up, self.inter)))
        if name.endswith("o_proj.weight"):
            return self.part(x, self.q, dim=1)
        if name.endswith("down_proj.weight"):
            return self.part(x, self.inter, dim=1)
        return x  # norms, o_proj's bias, rotary buffers: whole on every rank

    def vocab_rows(self, x: torch.Tensor) -> torch.Tensor:
        rows = vocab_per_rank(self.config.vocab_size, self.world_size)
        start = self.rank * rows
        mine = x[start : start + rows]
        if mine.shape[0] == rows:
            return mine
        padding = x.new_zeros((rows - mine.shape[0], *x.shape[1:]))
        return torch.cat((mine, padding))
