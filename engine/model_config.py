"""The model's shape: one frozen, validated ``ModelConfig`` whether it came from a Hugging Face
``config.json`` or from a GGUF file's metadata.

The model code (``engine/executor/models/``) builds itself from this config alone; the loaders and the KV-cache
sizing read it too. Field names follow transformers' ``LlamaConfig`` so the two are easy to compare.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.errors import ModelLoadError, UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "granite",
    "smollm3",
    "phi3",
    "gemma2",
    "gemma3_text",
)

# Gemma's layers (engine/executor/models/gemma.py): four norms a layer, (1 + weight) norms, GELU-tanh MLPs.
GEMMA_ARCHITECTURES: tuple[str, ...] = ("gemma2", "gemma3_text")

# transformers' class names (``architectures`` in config.json) -> our architecture names.
HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GraniteForCausalLM": "granite",
    "SmolLM3ForCausalLM": "smollm3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",  # the text-only Gemma 3 (1B; or a larger one's text tower alone)
}
_HF_CLASS_OF: dict[str, str] = {arch: cls for cls, arch in HF_ARCHITECTURES.items()}

# llama.cpp's ``general.architecture`` values we read. NOTE: llama.cpp converts Mistral checkpoints to
# architecture "llama" (same graph), so a Mistral GGUF loads as llama.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3", "linear")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """The hyper-parameters of a decoder-only Llama-family model.

    ``rope_scaling`` is ``None`` (plain RoPE) or a dict with ``rope_type`` ``"llama3"`` and the keys
    ``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``.
    ``eos_token_ids`` lists every id that ends generation (config.json may give several).

    The families beside Llama differ only in these (defaults: Llama's): Granite scales the embeddings by
    ``embedding_multiplier``, each block's output by ``residual_multiplier`` before it joins the residual,
    the attention scores by ``attention_multiplier`` (instead of ``head_dim ** -0.5``) and divides the
    logits by ``logits_scaling``; SmolLM3's ``no_rope_layers`` (layer indices) attend without rotary
    embeddings; Phi-3 stores q/k/v and gate/up fused in its checkpoint (the loader's concern).

    Gemma 2 and 3 (``GEMMA_ARCHITECTURES``, their own layer code) scale the embeddings by
    ``sqrt(hidden_size)`` (``embedding_multiplier``) and q.k by ``query_pre_attn_scalar ** -0.5``
    (``attention_multiplier``); Gemma 2 soft-caps attention scores (``attn_logit_softcapping``) and logits
    (``final_logit_softcapping``): ``cap * tanh(x / cap)``. Their ``sliding_window`` applies to every layer
    but ``full_attention_layers``; Gemma 3's sliding layers rotate with ``local_rope_theta`` (and no
    scaling) and it normalises q and k per head (``qk_norm``).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    no_rope_layers: tuple[int, ...] = ()
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    full_attention_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(self.architecture, SUPPORTED_ARCHITECTURES)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.architecture == "phi3" and self.attention_bias:
            raise ValueError("ModelConfig.attention_bias: Phi-3 has no biases")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        _validate_rope_scaling(self.rope_scaling)
        if not isinstance(self.eos_token_ids, tuple):
            # NOTE: frozen dataclass: normalise a list given by a caller without breaking immutability.
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for token_id in (*self.eos_token_ids, *(() if self.bos_token_id is None else (self.bos_token_id,))):
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"ModelConfig special token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(
                f"ModelConfig.sliding_window must be positive or None, got {self.sliding_window}"
            )
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.attention_multiplier is not None and not self.attention_multiplier > 0:
            raise ValueError(
                f"ModelConfig.attention_multiplier must be > 0, got {self.attention_multiplier!r}"
            )
        for name in ("no_rope_layers", "full_attention_layers"):
            layers = getattr(self, name)
            if not isinstance(layers, tuple):
                object.__setattr__(self, name, tuple(layers))
            if any(not 0 <= i < self.num_hidden_layers for i in layers):
                raise ValueError(f"ModelConfig.{name} names a layer outside 0..{self.num_hidden_layers - 1}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be > 0 or None, got {value!r}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attention_scale(self) -> float:
        """The factor of q·k: ``attention_multiplier`` where the config gives one, else ``head_dim ** -0.5``."""
        return self.attention_multiplier if self.attention_multiplier is not None else self.head_dim**-0.5

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: it attends over the whole context)."""
        return None if layer in self.full_attention_layers else self.sliding_window

    @property
    def norms_scale_in_float32(self) -> bool:
        """Gemma's RMSNorms scale by ``1 + weight`` in float32 and round once (transformers' Gemma norms);
        the others round the norm to the model's dtype, then scale (``RMSNorm``)."""
        return self.architecture in GEMMA_ARCHITECTURES

    @property
    def checkpoint_fuses_projections(self) -> bool:
        """The checkpoint stores ``qkv_proj`` and ``gate_up_proj`` fused (Phi-3) rather than their parts."""
        return self.architecture == "phi3"

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied (and validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ Hugging Face config.json
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], where: str = "config.json") -> ModelConfig:
        """Read a transformers ``config.json`` dict (4.x ``rope_theta``/``rope_scaling`` or 5.x
        ``rope_parameters``). ``where`` names the file in error messages."""
        architecture = _architecture_from_hf(d, where)
        try:
            hidden_size = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            rope_theta, rope_scaling = _rope_from_hf(d, 1e6 if architecture == "gemma3_text" else 1e4)
            head_dim = d.get("head_dim")
            return cls(
                architecture=architecture,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(head_dim) if head_dim else hidden_size // num_heads,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                # qwen2 always has q/k/v biases (its config has no flag); llama states it.
                attention_bias=architecture == "qwen2" or bool(d.get("attention_bias", False)),
                qk_norm=architecture in ("qwen3", "gemma3_text"),
                bos_token_id=optional_int(d.get("bos_token_id")),
                eos_token_ids=_id_tuple(d.get("eos_token_id")),
                sliding_window=_sliding_window_from_hf(d),
                **_family_fields(architecture, d),
            )
        except KeyError as e:
            raise ModelLoadError(f"{where}: missing required field {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            if isinstance(e, UnsupportedArchitectureError):
                raise
            raise ModelLoadError(f"{where}: invalid model config: {e}") from e

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict transformers (4.x and 5.x) reads back into the same model."""
        d: dict[str, Any] = {
            "architectures": [_HF_CLASS_OF[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids)
            if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
            "torch_dtype": "float32",
        }
        d.update(self._family_hf_fields())
        return d

    def _family_hf_fields(self) -> dict[str, Any]:
        """``to_hf_dict``'s fields of the architecture's own."""
        d: dict[str, Any] = {}
        if self.architecture == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        if self.architecture in ("mistral", "qwen2", "qwen3"):
            d["sliding_window"] = self.sliding_window
        if self.architecture in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
        if self.architecture == "qwen3":
            d["attention_bias"] = False
        if self.architecture == "granite":
            d.update(
                attention_bias=self.attention_bias,
                mlp_bias=False,
                embedding_multiplier=self.embedding_multiplier,
                residual_multiplier=self.residual_multiplier,
                attention_multiplier=self.attention_scale,
                logits_scaling=self.logits_scaling,
            )
        if self.architecture == "smollm3":
            d.update(
                attention_bias=self.attention_bias,
                mlp_bias=False,
                use_sliding_window=False,
                no_rope_layers=[int(i not in self.no_rope_layers) for i in range(self.num_hidden_layers)],
            )
        if self.architecture == "phi3":
            d.update(sliding_window=self.sliding_window, partial_rotary_factor=1.0)
        if self.architecture in GEMMA_ARCHITECTURES:
            scalar = round(self.attention_scale**-2, 6)  # transformers 5.x wants an int where it is one
            d.update(
                hidden_act="gelu_pytorch_tanh",
                hidden_activation="gelu_pytorch_tanh",
                attention_bias=self.attention_bias,
                query_pre_attn_scalar=int(scalar) if scalar.is_integer() else scalar,
                attn_logit_softcapping=self.attn_logit_softcapping,
                final_logit_softcapping=self.final_logit_softcapping,
                sliding_window=self.sliding_window,
                layer_types=[
                    "full_attention" if i in self.full_attention_layers else "sliding_attention"
                    for i in range(self.num_hidden_layers)
                ],
            )
        if self.architecture == "gemma3_text":
            d["rope_local_base_freq"] = self.local_rope_theta or self.rope_theta
        return d


# ---------------------------------------------------------------------- helpers
def _architecture_from_hf(d: Mapping[str, Any], where: str) -> str:
    classes = d.get("architectures") or []
    for cls_name in classes:
        if cls_name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[cls_name]
    model_type = d.get("model_type")
    if not classes and model_type in SUPPORTED_ARCHITECTURES:
        return str(model_type)
    named = classes[0] if classes else model_type
    raise UnsupportedArchitectureError(str(named), tuple(HF_ARCHITECTURES), where)


def _rope_from_hf(d: Mapping[str, Any], default_theta: float = 1e4) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from 4.x keys or 5.x ``rope_parameters`` (for a model whose layer
    types rotate differently, Gemma 3's, those of its ``full_attention`` layers)."""
    params = d.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    theta = d.get("rope_theta", params.get("rope_theta", default_theta))
    scaling = d.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        scaling = dict(scaling)
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("type", None)
        if rope_type == "default":
            return float(theta), None
        return float(theta), {"rope_type": rope_type, **scaling}
    return float(theta), None


def _validate_rope_scaling(scaling: dict[str, Any] | None) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "linear" and not float(scaling.get("factor", 0)) > 0:
        raise ValueError(f"linear rope_scaling needs a factor > 0, got {scaling}")
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_ROPE_KEYS if k not in scaling]
        if missing:
            raise ValueError(f"llama3 rope_scaling lacks {', '.join(missing)}")
        if not (scaling["factor"] > 0 and 0 < scaling["low_freq_factor"] < scaling["high_freq_factor"]):
            raise ValueError(f"llama3 rope_scaling needs factor > 0 and 0 < low < high factor, got {scaling}")


def _family_fields(architecture: str, d: Mapping[str, Any]) -> dict[str, Any]:
    """The ``ModelConfig`` fields a family beside Llama adds; ``ValueError`` for a variant the native code
    does not compute (the transformers backend serves it under ``--model-impl auto``)."""
    if d.get("mlp_bias"):
        raise ValueError("MLP biases (mlp_bias) are not native")
    if architecture in GEMMA_ARCHITECTURES:
        return _gemma_fields(architecture, d)
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"the activation {d.get('hidden_act')!r} is not native (SiLU-gated MLPs are)")
    if architecture == "granite":
        return {
            "embedding_multiplier": float(d.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(d.get("residual_multiplier", 1.0)),
            "attention_multiplier": float(d.get("attention_multiplier", 1.0)),
            "logits_scaling": float(d.get("logits_scaling", 1.0)),
        }
    if architecture == "smollm3":
        num_layers, interval = int(d["num_hidden_layers"]), int(d.get("no_rope_layer_interval", 4))
        uses_rope = d.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
        if d.get("use_sliding_window") and d.get("sliding_window"):
            raise ValueError("SmolLM3 with per-layer sliding windows (use_sliding_window) is not native")
        return {"no_rope_layers": tuple(i for i, rope in enumerate(uses_rope) if not rope)}
    if architecture == "phi3":
        factor = (d.get("rope_parameters") or {}).get(
            "partial_rotary_factor", d.get("partial_rotary_factor", 1.0)
        )
        if float(factor) != 1.0:
            raise ValueError(
                f"Phi-3 with partial rotary embeddings (partial_rotary_factor {factor}) is not native"
            )
    return {}


def _gemma_fields(architecture: str, d: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 2 / Gemma 3 (text): the scales, soft caps, global layers and local RoPE of ``ModelConfig``."""
    activation = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma with the activation {activation!r} is not native (GELU-tanh is)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("Gemma with bidirectional attention (use_bidirectional_attention) is not native")
    num_layers = int(d["num_hidden_layers"])
    pattern = 2 if architecture == "gemma2" else int(d.get("sliding_window_pattern", 6))
    default_types = [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]
    layer_types = list(d.get("layer_types") or default_types)
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown or len(layer_types) != num_layers:
        raise ValueError(f"Gemma layer_types {layer_types} are not native (one of sliding/full a layer)")
    fields: dict[str, Any] = {
        "embedding_multiplier": float(d["hidden_size"]) ** 0.5,
        "attention_multiplier": float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_logit_softcapping": optional_float(d.get("attn_logit_softcapping")),
        "final_logit_softcapping": optional_float(d.get("final_logit_softcapping")),
        "full_attention_layers": tuple(i for i, t in enumerate(layer_types) if t == "full_attention"),
    }
    if architecture == "gemma3_text":
        local = (d.get("rope_parameters") or {}).get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma 3 with {local['rope_type']!r} RoPE on its sliding layers is not native")
        fields["local_rope_theta"] = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
    return fields


def _sliding_window_from_hf(d: Mapping[str, Any]) -> int | None:
    # Qwen configs carry a window even when use_sliding_window is false: then it is not in effect.
    if d.get("use_sliding_window") is False:
        return None
    return optional_int(d.get("sliding_window"))


def optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(dict.fromkeys(int(v) for v in value))
