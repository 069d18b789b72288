"""ModelConfig from GGUF metadata and from Hugging Face config.json dicts, its validation and round trip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from engine.errors import ModelLoadError, UnsupportedArchitectureError
from engine.executor.models.registry import choose_model_impl, native_config_error
from engine.loader.gguf import config_from_gguf
from engine.model_config import ModelConfig

TINY: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def _hf(config: Any) -> dict[str, Any]:
    d = config.to_dict()
    name = type(config).__name__.replace("Config", "ForCausalLM")
    d["architectures"] = [name.replace("Gemma3TextForCausalLM", "Gemma3ForCausalLM")]
    return d


def test_from_smollm2_gguf_equals_transformers_config(
    smollm2_reader: Any, smollm2_gguf_path: Path, oracle_config: Any
) -> None:
    ours = config_from_gguf(smollm2_reader, str(smollm2_gguf_path))
    theirs = oracle_config
    assert ours.architecture == theirs.model_type == "llama"
    assert ours.vocab_size == theirs.vocab_size == 49152
    assert ours.hidden_size == theirs.hidden_size == 576
    assert ours.intermediate_size == theirs.intermediate_size
    assert ours.num_hidden_layers == theirs.num_hidden_layers == 30
    assert ours.num_attention_heads == theirs.num_attention_heads == 9
    assert ours.num_key_value_heads == theirs.num_key_value_heads == 3
    assert ours.head_dim == theirs.hidden_size // theirs.num_attention_heads == 64
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 100000.0
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    assert ours.max_position_embeddings == theirs.max_position_embeddings == 8192
    assert ours.tie_word_embeddings is True and theirs.tie_word_embeddings is True
    assert ours.attention_bias is False and ours.qk_norm is False and ours.rope_scaling is None
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,)


def test_from_tiny_llama_dict() -> None:
    c = ModelConfig.from_hf_dict(
        _hf(
            LlamaConfig(
                **TINY, rope_parameters={"rope_type": "default", "rope_theta": 5e5}, tie_word_embeddings=True
            )
        )
    )
    assert c.architecture == "llama" and c.head_dim == 16 and c.num_queries_per_kv == 2
    assert c.rope_theta == 5e5 and c.tie_word_embeddings and not c.attention_bias and not c.qk_norm
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1


def test_from_llama3_rope_scaling_5x_and_4x_styles() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    five = _hf(LlamaConfig(**TINY, rope_parameters={**scaling, "rope_theta": 5e5}))
    assert "rope_parameters" in five
    c5 = ModelConfig.from_hf_dict(five)
    # transformers 4.x writes rope_theta and rope_scaling (with the legacy "type" key) at top level
    four = {k: v for k, v in five.items() if k != "rope_parameters"}
    four.update(
        rope_theta=5e5,
        rope_scaling={**{k: v for k, v in scaling.items() if k != "rope_type"}, "type": "llama3"},
    )
    c4 = ModelConfig.from_hf_dict(four)
    assert c5 == c4
    assert c5.rope_theta == 5e5 and c5.rope_scaling == scaling


def test_from_tiny_qwen2_and_qwen3_dicts() -> None:
    q2 = ModelConfig.from_hf_dict(_hf(Qwen2Config(**TINY, sliding_window=64, use_sliding_window=False)))
    assert q2.architecture == "qwen2" and q2.attention_bias and not q2.qk_norm
    assert q2.sliding_window is None  # present but not in effect
    q3 = ModelConfig.from_hf_dict(_hf(Qwen3Config(**TINY, head_dim=32)))
    assert q3.architecture == "qwen3" and q3.qk_norm and not q3.attention_bias and q3.head_dim == 32


def test_from_mistral_keeps_sliding_window_and_eos_list() -> None:
    d = _hf(MistralConfig(**{**TINY, "eos_token_id": [2, 3]}, sliding_window=32))
    c = ModelConfig.from_hf_dict(d)
    assert c.architecture == "mistral" and c.sliding_window == 32 and c.eos_token_ids == (2, 3)


@pytest.mark.parametrize(
    "cls", [LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Gemma2Config, Gemma3TextConfig]
)
def test_to_hf_dict_round_trips_through_us_and_transformers(cls: Any) -> None:
    from transformers import AutoConfig

    ours = ModelConfig.from_hf_dict(_hf(cls(**TINY)))
    d = ours.to_hf_dict()
    assert ModelConfig.from_hf_dict(d) == ours
    theirs = AutoConfig.for_model(d.pop("model_type"), **d)
    assert ModelConfig.from_hf_dict({**theirs.to_dict(), "architectures": d["architectures"]}) == ours


def test_unsupported_architecture_names_the_supported_ones() -> None:
    d = {**TINY, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel") as info:
        ModelConfig.from_hf_dict(d, where="/models/gpt2/config.json")
    message = str(info.value)
    assert "/models/gpt2/config.json" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message
    with pytest.raises(UnsupportedArchitectureError, match="llama, mistral, qwen2, qwen3"):
        ModelConfig(architecture="gpt2", **_fields())


def test_from_gemma2_dict() -> None:
    c = ModelConfig.from_hf_dict(_hf(Gemma2Config(**TINY, head_dim=16, sliding_window=32)))
    assert c.architecture == "gemma2" and not c.qk_norm and c.local_rope_theta is None
    assert c.embedding_multiplier == 8.0 and c.attention_scale == 256**-0.5  # query_pre_attn_scalar 256
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0)
    assert [c.layer_window(i) for i in range(2)] == [32, None]  # sliding, then global


def test_from_gemma3_rope_5x_and_4x_styles() -> None:
    """5.x: a RoPE per layer type; 4.x (the Hub's configs): rope_theta, rope_local_base_freq, rope_scaling
    and sliding_window_pattern at top level."""
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    five = _hf(Gemma3TextConfig(**{**TINY, "num_hidden_layers": 6}, head_dim=16, rope_parameters=rope))
    four = {k: v for k, v in five.items() if k not in ("rope_parameters", "layer_types")}
    four.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                sliding_window_pattern=6)  # fmt: skip
    c5, c4 = ModelConfig.from_hf_dict(five), ModelConfig.from_hf_dict(four)
    assert c5 == c4
    assert c5.architecture == "gemma3_text" and c5.qk_norm and c5.full_attention_layers == (5,)
    assert c5.rope_theta == 1e6 and c5.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert c5.local_rope_theta == 1e4 and c5.attn_logit_softcapping is None
    assert ModelConfig.from_hf_dict({**four, "architectures": [], "model_type": "gemma3_text"}) == c4


@pytest.mark.parametrize(
    ("cls", "fields", "edit", "reason"),
    [
        (Gemma2Config, {"hidden_activation": "gelu"}, {}, "activation 'gelu'"),
        (Gemma3TextConfig, {"use_bidirectional_attention": True}, {}, "bidirectional attention"),
        (Gemma2Config, {}, {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
        (
            Gemma3TextConfig,
            {},
            {"rope_parameters": {"sliding_attention": {"rope_type": "yarn"}}},
            "sliding layers",
        ),
    ],
)
def test_gemma_variants_the_native_code_does_not_compute_go_to_the_backend(
    cls: Any, fields: dict[str, Any], edit: dict[str, Any], reason: str
) -> None:
    d = {**_hf(cls(**TINY, head_dim=16, **fields)), **edit}
    assert reason in str(native_config_error(d))
    assert choose_model_impl(d) == "transformers"
    assert choose_model_impl(_hf(cls(**TINY, head_dim=16))) == "native"


def test_model_type_alone_is_enough() -> None:
    d = {**TINY, "model_type": "qwen3"}
    assert ModelConfig.from_hf_dict(d).architecture == "qwen3"


def _fields(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
        max_position_embeddings=256,
    )
    base.update(changes)
    return base


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"hidden_size": 0}, "hidden_size must be a positive integer"),
        ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps must be > 0"),
        ({"rope_theta": -1.0}, "rope_theta must be > 0"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, "linear rope_scaling needs a factor"),
        ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping must be > 0"),
        ({"full_attention_layers": (2,)}, "full_attention_layers names a layer outside 0..1"),
        ({"eos_token_ids": (500,)}, "outside the vocabulary"),
        ({"sliding_window": 0}, "sliding_window must be positive"),
    ],
)
def test_validation_errors(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig(architecture="llama", **_fields(**changes))


def test_frozen_and_replace_revalidates() -> None:
    c = ModelConfig(architecture="llama", **_fields(), eos_token_ids=[2, 3])  # type: ignore[arg-type]
    assert c.eos_token_ids == (2, 3)
    with pytest.raises(AttributeError):
        c.hidden_size = 32  # type: ignore[misc]
    assert c.replace(eos_token_ids=(4,)).eos_token_ids == (4,)
    with pytest.raises(ValueError):
        c.replace(num_key_value_heads=3)


def test_missing_field_names_the_file() -> None:
    d = _hf(LlamaConfig(**TINY))
    del d["hidden_size"]
    with pytest.raises(ModelLoadError, match=r"my/config.json: missing required field 'hidden_size'"):
        ModelConfig.from_hf_dict(d, where="my/config.json")
