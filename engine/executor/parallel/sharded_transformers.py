"""One rank's shard of a model served by the transformers backend: transformers' own modeling code, its
planned modules cut and hooked to the ranks' collectives by the model's own tensor-parallel plan
(engine/executor/parallel/transformers_plan.py). Every rank runs the same forward over the heads its
attention computes, into its own KV pages; each ends with the whole logits (the head's outputs gathered)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from engine.executor.models.transformers_backend import TransformersForCausalLM, probe_attention
from engine.executor.models.transformers_config import TransformersModelConfig
from engine.executor.parallel.group import ShardGroup
from engine.executor.parallel.sharding import ShardingError
from engine.executor.parallel.transformers_plan import apply_plan, heads_per_rank, planned_modules

if TYPE_CHECKING:
    from engine.executor.parallel.workers import ShardWorkers


class ShardedTransformersForCausalLM(TransformersForCausalLM):
    """Rank ``group.rank``'s shard. ``config`` is the shard's (the heads and KV heads its attention computes:
    its KV cache's shape); ``full_config`` the whole model's. On rank 0, ``workers`` are the other ranks."""

    def __init__(
        self,
        hf_model: nn.Module,
        config: TransformersModelConfig,
        kv_layers: dict[int, int],
        full_config: TransformersModelConfig,
        group: ShardGroup,
    ) -> None:
        super().__init__(hf_model, config, kv_layers)
        self.full_config = full_config
        self.group = group
        self.workers: ShardWorkers | None = None

    @classmethod
    def shard(cls, hf_model: nn.Module, model: str, group: ShardGroup) -> ShardedTransformersForCausalLM:
        """``hf_model`` (whole, weights loaded) cut to rank ``group.rank``'s part. Every rank calls this at
        once: the last probe runs the collectives. Raises ``ShardingError`` (and ``UnsupportedModelError``
        as ``TransformersForCausalLM.wrap``)."""
        whole = TransformersForCausalLM.wrap(hf_model, model)  # one process's probe: no collective yet
        modules = planned_modules(hf_model, group.world_size, model)
        heads, kv_heads = heads_per_rank(
            modules,
            whole.config.num_attention_heads,
            whole.config.num_key_value_heads,
            group.world_size,
            model,
        )
        apply_plan(hf_model, modules, group)
        shapes = {(call.num_heads, call.num_kv_heads) for call in probe_attention(hf_model)}
        if shapes != {(heads, kv_heads)}:
            raise ShardingError(
                f"{model}: under its tensor-parallel plan a rank's attention computes (heads, KV heads) "
                f"{sorted(shapes)}, not ({heads}, {kv_heads})"
            )
        config = whole.config.replace(num_attention_heads=heads, num_key_value_heads=kv_heads)
        return cls(hf_model, config, whole.kv_layers, whole.config, group)

    def close(self) -> None:
        """Rank 0: stop the other ranks' processes (idempotent)."""
        if self.workers is not None:
            self.workers.close()
