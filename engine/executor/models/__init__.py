"""Model implementations. ``build_model(config, dtype, device)`` picks the class for ``config.architecture``;
every model has ``forward(inputs: BatchInputs, kv_cache: KVCache) -> logits`` and ``load_weights``."""

from engine.executor.models.llama import LlamaForCausalLM, WeightMismatchError
from engine.executor.models.registry import build_model, supported_architectures

__all__ = ["LlamaForCausalLM", "WeightMismatchError", "build_model", "supported_architectures"]
