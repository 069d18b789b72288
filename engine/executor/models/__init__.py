"""Model implementations. ``build_model(config, dtype, device)`` picks the native class for
``config.architecture`` (with ``load_weights``); the transformers backend (``transformers_backend.py``) runs
any other decoder-only causal LM. Every model has ``forward(inputs: BatchInputs, kv_cache: KVCache,
decode_kernel) -> logits``."""

from engine.executor.models.decoder_only import WeightMismatchError
from engine.executor.models.llama import LlamaForCausalLM
from engine.executor.models.registry import build_model, supported_architectures

__all__ = ["LlamaForCausalLM", "WeightMismatchError", "build_model", "supported_architectures"]
