"""The shards of each checkpoint tensor (engine/executor/parallel/sharding.py): the ranks' slices put back
together are the tensor (q/k/v and gate/up rows by head and by intermediate row, fused or not; o_proj and
down columns; vocabulary rows, the last rank's padded with zeros); norms and o_proj's bias are whole."""

from __future__ import annotations

import pytest
import torch

from engine.executor.parallel.sharding import ShardingError, check_shardable, shard_config, shard_weights
from engine.loader.dummy import iter_dummy_weights
from engine.model_config import ModelConfig

WORLD = 2


def _unshard(name: str, parts: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The inverse of the cut, written from the layout (not from the cutter)."""
    q, kv, inter = (
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
        config.intermediate_size,
    )
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return torch.cat(parts)[: config.vocab_size]
    if name.endswith("qkv_proj.weight"):
        splits = [p.split([q // WORLD, kv // WORLD, kv // WORLD]) for p in parts]
        return torch.cat([torch.cat([s[i] for s in splits]) for i in range(3)])
    if name.endswith("gate_up_proj.weight"):
        halves = [p.split([inter // WORLD, inter // WORLD]) for p in parts]
        return torch.cat([torch.cat([h[i] for h in halves]) for i in range(2)])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return torch.cat(parts, dim=1)
    if any(f"{x}_proj" in name for x in ("q", "k", "v", "gate", "up")):
        return torch.cat(parts)
    assert all(torch.equal(p, parts[0]) for p in parts)  # whole on every rank
    return parts[0]


@pytest.mark.parametrize(
    "changes",
    [
        {"vocab_size": 257},  # the last rank gets a padded row
        {"architecture": "qwen2", "attention_bias": True},
        {"architecture": "phi3"},  # fused q/k/v and gate/up tensors
        {"attention_bias": True, "qk_norm": True, "tie_word_embeddings": True},
    ],
)
def test_the_ranks_slices_put_back_together_are_the_tensor(
    tiny_model_config: ModelConfig, changes: dict[str, object]
) -> None:
    config = tiny_model_config.replace(**changes)
    whole = dict(iter_dummy_weights(config))
    ranks = [dict(shard_weights(iter_dummy_weights(config), config, r, WORLD)) for r in range(WORLD)]
    local = shard_config(config, WORLD)
    assert local.num_attention_heads == 2 and local.num_key_value_heads == 1
    for name, tensor in whole.items():
        parts = [rank[name] for rank in ranks]
        if name == "model.embed_tokens.weight":
            assert all(p.shape[0] == local.vocab_size for p in parts)
            pad = WORLD * local.vocab_size - config.vocab_size
            assert pad == 0 or torch.count_nonzero(parts[-1][-pad:]) == 0
        assert torch.equal(_unshard(name, parts, config), tensor), name


def test_sizes_that_do_not_divide_the_model_are_refused(tiny_model_config: ModelConfig) -> None:
    check_shardable(tiny_model_config, 2)
    with pytest.raises(ShardingError, match="must divide the model's 4 attention heads, its 2 KV heads"):
        check_shardable(tiny_model_config, 4)
    with pytest.raises(ShardingError, match="positive integer"):
        check_shardable(tiny_model_config, 0)
