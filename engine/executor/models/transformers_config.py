"""A model served through transformers' own modeling code: its transformers config and class, and the shape
the engine sizes its KV cache and sampler from (``TransformersModelConfig``).

transformers is imported here lazily: the native path never pays for it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

# NOTE: the limit a config without max_position_embeddings gets, as for the native path's configs.
DEFAULT_MAX_POSITIONS = 2048


def hf_config_from_dict(d: Mapping[str, Any], model: str) -> Any:
    """The ``transformers.PretrainedConfig`` of a ``config.json`` dict. An unknown ``model_type`` raises
    ``UnsupportedModelError`` naming it."""
    from transformers import AutoConfig, __version__

    model_type = d.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UnsupportedModelError(
            model, "its config.json has no model_type, so transformers cannot build it"
        )
    try:
        return AutoConfig.for_model(model_type, **{k: v for k, v in d.items() if k != "model_type"})
    except ValueError as e:
        raise UnsupportedModelError(
            model, f"model type {model_type!r} is unknown to the installed transformers {__version__}"
        ) from e


def causal_lm_class(hf_config: Any, model: str) -> type[Any]:
    """The transformers ``*ForCausalLM`` class of ``hf_config``: the first of its ``architectures`` that is a
    causal LM class, else the one transformers maps its model type to. Encoder-decoder and encoder-only
    models, and architectures that are no causal LM, raise ``UnsupportedModelError``."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    model_type = hf_config.model_type
    if getattr(hf_config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            model, f"{model_type!r} is an encoder-decoder model; cbserve serves decoder-only causal LMs"
        )
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    named = list(getattr(hf_config, "architectures", None) or [])
    for name in named:
        if name in causal and hasattr(transformers, name):
            return getattr(transformers, name)  # type: ignore[no-any-return]
    if named:
        raise UnsupportedModelError(
            model, f"{', '.join(named)} is not a decoder-only causal LM class of transformers"
        )
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(hf_config, "is_decoder", False):
        raise UnsupportedModelError(
            model, f"{model_type!r} is an encoder-only model; cbserve serves causal LMs"
        )
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None or not hasattr(transformers, name):
        raise UnsupportedModelError(
            model, f"transformers has no causal LM class for model type {model_type!r}"
        )
    return getattr(transformers, name)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class TransformersModelConfig:
    """What the engine reads of a model that runs through transformers: the vocabulary, the context limit,
    the special ids, and the attention layout found by running the model (engine/executor/models/
    transformers_backend.py): its KV cache has one layer per attention layer, each of ``num_key_value_heads``
    heads of ``head_dim``; ``sliding_windows`` holds each of those layers' window (None: full attention)."""

    architecture: str  # the transformers class, e.g. "Gemma2ForCausalLM"
    vocab_size: int
    num_hidden_layers: int  # attention layers: the KV cache's layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_windows: tuple[int | None, ...] = ()
    attn_logit_softcapping: float | None = None  # the layers' soft cap of attention scores (Gemma 2's)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes: Any) -> TransformersModelConfig:
        return dataclasses.replace(self, **changes)


def text_fields(hf_config: Any, model: str) -> dict[str, Any]:
    """The vocabulary, context limit and special ids of ``hf_config`` (its text config for a composite)."""
    text = hf_config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        logger.warning(
            "%s: no max_position_embeddings in its config; serving %d tokens", model, DEFAULT_MAX_POSITIONS
        )
        limit = DEFAULT_MAX_POSITIONS
    eos = getattr(text, "eos_token_id", None)
    eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(int(i) for i in eos)
    bos = getattr(text, "bos_token_id", None)
    return {
        "vocab_size": int(text.vocab_size),
        "max_position_embeddings": limit,
        "bos_token_id": bos if isinstance(bos, int) else None,
        "eos_token_ids": tuple(i for i in eos_ids if 0 <= i < int(text.vocab_size)),
    }
