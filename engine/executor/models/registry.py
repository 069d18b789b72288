"""Architecture name -> model class, ``build_model``: the one place that constructs a native model, and
``choose_model_impl``: which implementation serves a checkpoint (``--model-impl``)."""

from __future__ import annotations

from typing import Any

import torch

from engine.errors import ModelLoadError, UnsupportedArchitectureError
from engine.executor.models.gemma import GemmaForCausalLM
from engine.executor.models.llama import LlamaForCausalLM
from engine.model_config import HF_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig

# The native models: what fast_paths, the loaders and the engine take.
NativeModel = LlamaForCausalLM | GemmaForCausalLM

# Every architecture of the Llama family shares one implementation; the differences (biases, q/k norm,
# rope scaling, sliding window, Granite's multipliers, SmolLM3's NoPE layers, Phi-3's fused checkpoint
# tensors) are read from the config. Gemma 2 and 3 have their own layers (sandwich norms, GELU-tanh).
MODEL_CLASSES: dict[str, type[NativeModel]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "granite": LlamaForCausalLM,
    "smollm3": LlamaForCausalLM,
    "phi3": LlamaForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
}


# vLLM's spelling: ``native`` is cbserve's own model code (the Llama family), ``transformers`` the transformers
# backend (engine/executor/models/transformers_backend.py), ``auto`` the native code where there is one.
MODEL_IMPLS: tuple[str, ...] = ("auto", "native", "transformers")


def supported_architectures() -> tuple[str, ...]:
    return tuple(MODEL_CLASSES)


def choose_model_impl(hf_config: dict[str, Any], model_impl: str = "auto") -> str:
    """``"native"`` or ``"transformers"`` for a checkpoint of ``config.json`` ``hf_config``: ``auto`` picks
    the native code for the architectures and variants it implements, the transformers backend for any
    other (a Llama with YaRN RoPE scaling, a Phi-3 with partial rotary embeddings, ...). Raises
    ``ValueError`` for an unknown ``model_impl``."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"unknown model_impl {model_impl!r}; expected one of {', '.join(MODEL_IMPLS)}")
    if model_impl != "auto":
        return model_impl
    classes = hf_config.get("architectures") or []
    native = any(name in HF_ARCHITECTURES for name in classes) or (
        not classes and hf_config.get("model_type") in SUPPORTED_ARCHITECTURES
    )
    return "native" if native and native_config_error(hf_config) is None else "transformers"


def native_config_error(hf_config: dict[str, Any]) -> str | None:
    """Why the native code cannot compute this checkpoint of a family it implements (a RoPE scaling, an
    activation, per-layer windows it lacks), or None."""
    try:
        ModelConfig.from_hf_dict(hf_config)
    except ModelLoadError as exc:
        return str(exc)
    return None


def build_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> NativeModel:
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
