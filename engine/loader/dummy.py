"""Random weights for a ``ModelConfig``: benchmarks and memory tests of real model shapes without a download.

Weights are generated lazily, one tensor at a time, directly in the requested dtype on the requested
device (a dummy Llama-3-8B in bfloat16 on a GPU never needs a float32 or host copy). Linear,
embedding and bias tensors are ``normal(0, 0.02)`` (transformers' ``initializer_range``), norm weights 1.
Each tensor has its own seed derived from the base seed and its index, so its values do not depend on
how far a consumer iterated.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.model_config import GEMMA_ARCHITECTURES, ModelConfig

DUMMY_STD = 0.02

_LLAMA3_EOS = (128001, 128008, 128009)

# Shapes of the real models (their config.json), so a dummy has the real compute and memory footprint.
PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
    ),
    "llama-3.2-1b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_ids=_LLAMA3_EOS,
    ),
    "llama-3-8b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_ids=(128001, 128009),
    ),
    "qwen2.5-7b": ModelConfig(
        architecture="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        attention_bias=True,
        bos_token_id=151643,
        eos_token_ids=(151645, 151643),
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The config of preset ``name``; an unknown name raises ``ValueError`` listing the presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown dummy model preset {name!r}; presets: {', '.join(PRESETS)}") from None


def weight_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter of the model in Hugging Face names, in checkpoint order, with its shape."""
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    q = config.num_attention_heads * config.head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config.vocab_size, h))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        fused = config.checkpoint_fuses_projections  # Phi-3 stores q/k/v and gate/up as one tensor each
        shapes.append((f"{p}.input_layernorm.weight", (h,)))
        if fused:
            shapes.append((f"{p}.self_attn.qkv_proj.weight", (q + 2 * kv, h)))
        else:
            shapes += [
                (f"{p}.self_attn.{x}_proj.weight", (n, h)) for x, n in (("q", q), ("k", kv), ("v", kv))
            ]
        shapes.append((f"{p}.self_attn.o_proj.weight", (h, q)))
        if config.attention_bias:
            shapes += [(f"{p}.self_attn.{x}_proj.bias", (n,)) for x, n in (("q", q), ("k", kv), ("v", kv))]
            if config.architecture != "qwen2":  # NOTE: Qwen2's flag biases q/k/v only (as the model does)
                shapes.append((f"{p}.self_attn.o_proj.bias", (h,)))
        if config.qk_norm:
            shapes += [(f"{p}.self_attn.q_norm.weight", (config.head_dim,))]
            shapes += [(f"{p}.self_attn.k_norm.weight", (config.head_dim,))]
        shapes.append((f"{p}.post_attention_layernorm.weight", (h,)))
        if config.architecture in GEMMA_ARCHITECTURES:  # the norms around the MLP
            shapes.append((f"{p}.pre_feedforward_layernorm.weight", (h,)))
            shapes.append((f"{p}.post_feedforward_layernorm.weight", (h,)))
        inter = config.intermediate_size
        if fused:
            shapes.append((f"{p}.mlp.gate_up_proj.weight", (2 * inter, h)))
        else:
            shapes += [(f"{p}.mlp.gate_proj.weight", (inter, h)), (f"{p}.mlp.up_proj.weight", (inter, h))]
        shapes.append((f"{p}.mlp.down_proj.weight", (h, inter)))
    shapes.append(("model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        shapes.append(("lm_head.weight", (config.vocab_size, h)))
    return shapes


def iter_dummy_weights(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` random weights for ``config``, one tensor at a time."""
    device = torch.device(device)
    for index, (name, shape) in enumerate(weight_shapes(config)):
        if name.endswith("norm.weight"):  # a norm of scale 1 (Gemma's norms scale by 1 + weight)
            fill = torch.zeros if config.architecture in GEMMA_ARCHITECTURES else torch.ones
            yield name, fill(shape, dtype=dtype, device=device)
        else:
            generator = torch.Generator(device=device)
            generator.manual_seed(seed * 1_000_003 + index)
            yield (
                name,
                torch.empty(shape, dtype=dtype, device=device).normal_(0.0, DUMMY_STD, generator=generator),
            )
