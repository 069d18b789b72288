"""One rank's shard of a model served by the transformers backend: transformers' own modeling code, its
planned modules holding the rank's parts and hooked to the ranks' collectives by the model's own
tensor-parallel plan (engine/executor/parallel/transformers_plan.py). Every rank runs the same forward over the heads its
attention computes, into its own KV pages; each ends with the whole logits (the head's outputs gathered)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from engine.executor.models.transformers_backend import TransformersForCausalLM
from engine.executor.models.transformers_config import TransformersModelConfig
from engine.executor.parallel.group import ShardGroup
from engine.executor.parallel.sharding import ShardingError
from engine.executor.parallel.transformers_plan import heads_per_rank, hook_plan

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
    def shard(
        cls, hf_model: nn.Module, modules: dict[str, str], model: str, group: ShardGroup
    ) -> ShardedTransformersForCausalLM:
        """``hf_model`` holding rank ``group.rank``'s parts of its planned ``modules`` (``planned_modules``:
        engine/loader/transformers_slices.py reads them, or ``cut_to_rank`` cuts them), hooked to the ranks'
        collectives. Every rank calls this at once: the probe forward runs the collectives. Raises
        ``ShardingError`` (and ``UnsupportedModelError`` as ``TransformersForCausalLM.wrap``)."""
        hf_config: Any = hf_model.config
        text = hf_config.get_text_config()
        whole_heads = int(text.num_attention_heads)
        whole_kv_heads = int(getattr(text, "num_key_value_heads", None) or whole_heads)
        heads, kv_heads = heads_per_rank(modules, whole_heads, whole_kv_heads, group.world_size, model)
        hook_plan(hf_model, modules, group)
        mine = TransformersForCausalLM.wrap(hf_model, model)
        shape = (mine.config.num_attention_heads, mine.config.num_key_value_heads)
        if shape != (heads, kv_heads):
            raise ShardingError(
                f"{model}: under its tensor-parallel plan a rank's attention computes (heads, KV heads) "
                f"{shape}, not ({heads}, {kv_heads})"
            )
        full = mine.config.replace(num_attention_heads=whole_heads, num_key_value_heads=whole_kv_heads)
        return cls(hf_model, mine.config, mine.kv_layers, full, group)

    def close(self) -> None:
        """Rank 0: stop the other ranks' processes (idempotent)."""
        if self.workers is not None:
            self.workers.close()
