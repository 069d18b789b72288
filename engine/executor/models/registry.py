"""Architecture name -> model class, and ``build_model``: the one place that constructs a model."""

from __future__ import annotations

import torch

from engine.errors import UnsupportedArchitectureError
from engine.executor.models.llama import LlamaForCausalLM
from engine.model_config import ModelConfig

# Every architecture of the Llama family shares one implementation; the differences (biases, q/k norm,
# rope scaling, sliding window) are read from the config.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(MODEL_CLASSES)


def build_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> LlamaForCausalLM:
    """An eval-mode model whose parameters are allocated (uninitialised, directly in ``dtype`` on ``device``:
    no fp32 copy, no random init) and wait for ``load_weights``. Raises ``UnsupportedArchitectureError``
    naming the supported architectures."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise UnsupportedArchitectureError(config.architecture, supported_architectures())
    if not dtype.is_floating_point:
        raise ValueError(f"build_model: dtype must be a floating point dtype, got {dtype}")
    model = cls(config, dtype=dtype, device=device)
    model.eval()
    return model
