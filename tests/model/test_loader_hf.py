"""Hugging Face folders: our safetensors loader yields transformers' state dict exactly (single file and
sharded with an index); ``save_hf_folder`` round-trips the GGUF's weights (through us and transformers);
``load_model`` builds a working model from a folder; dummy weights and model sources."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from engine.loader.dummy import PRESETS, get_preset, iter_dummy_weights, weight_shapes
from engine.loader.gguf import config_from_gguf, iter_gguf_weights
from engine.loader.hf import (
    iter_safetensors_weights,
    load_generation_config,
    load_hf_config,
    safetensors_files,
    save_hf_folder,
)
from engine.loader.source import resolve_model
from engine.loader.tokenizer import Tokenizer
from engine.model_config import ModelConfig

TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)
ARCHS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def _tiny_model(arch: str, tie: bool, vocab_size: int = 256) -> Any:
    torch.manual_seed(0)
    config = ARCHS[arch](**{**TINY, "vocab_size": vocab_size}, tie_word_embeddings=tie)
    config.architectures = [f"{type(config).__name__.replace('Config', '')}ForCausalLM"]
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms and biases start at 1/0: randomise them so a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _expected_state(model: Any) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


@pytest.mark.parametrize(("arch", "tie"), [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)])
@pytest.mark.parametrize("sharded", [False, True])
def test_safetensors_folder_yields_state_dict_exactly(tmp_path: Path, arch: str, tie: bool, sharded: bool) -> None:
    model = _tiny_model(arch, tie)
    model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "50GB")
    files = safetensors_files(tmp_path)
    assert (len(files) > 2) == sharded
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded

    ours = dict(iter_safetensors_weights(tmp_path))
    expected = _expected_state(model)
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name

    config = load_hf_config(tmp_path)
    assert config == ModelConfig.from_hf_dict(model.config.to_dict())
    assert config.architecture == arch and config.tie_word_embeddings == tie
    assert config.attention_bias == (arch == "qwen2") and config.qk_norm == (arch == "qwen3")
    assert "eos_token_id" in load_generation_config(tmp_path)


def test_dtype_cast_on_load(tmp_path: Path) -> None:
    _tiny_model("llama", True).save_pretrained(tmp_path)
    assert {t.dtype for _, t in iter_safetensors_weights(tmp_path, dtype=torch.bfloat16)} == {torch.bfloat16}


def test_save_hf_folder_round_trips_the_gguf(
    tmp_path: Path, smollm2_reader: Any, smollm2_gguf_path: Path
) -> None:
    config = config_from_gguf(smollm2_reader, str(smollm2_gguf_path))
    tokenizer = Tokenizer.from_gguf(smollm2_reader, str(smollm2_gguf_path))
    original = dict(iter_gguf_weights(smollm2_reader.tensors, config))
    save_hf_folder(
        tmp_path,
        config,
        original.items(),
        tokenizer=tokenizer,
        generation_config={"bos_token_id": 1, "eos_token_id": 2},
        max_shard_bytes=200_000_000,
    )
    assert len(safetensors_files(tmp_path)) == 3  # 540 MB of fp32 in shards of <= 200 MB
    # through us
    assert load_hf_config(tmp_path) == config
    assert load_generation_config(tmp_path) == {"bos_token_id": 1, "eos_token_id": 2}
    reread = dict(iter_safetensors_weights(tmp_path))
    assert sorted(reread) == sorted(original)
    assert all(torch.equal(reread[k], v) for k, v in original.items())
    reloaded_tok = Tokenizer.from_pretrained(tmp_path)
    assert reloaded_tok.encode("Hello <|im_start|> world 123") == tokenizer.encode("Hello <|im_start|> world 123")
    del reread
    # through transformers: it reads our config.json and index and ties lm_head to the embedding
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    state = theirs.state_dict()
    assert torch.equal(state["lm_head.weight"], original["model.embed_tokens.weight"])
    for name, tensor in original.items():
        assert torch.equal(state[name], tensor), name
    source = resolve_model(str(tmp_path))
    assert source.kind == "safetensors" and source.path == tmp_path


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_load_model_from_folder_matches_transformers_logits(tmp_path: Path, arch: str) -> None:
    """End to end: load_model -> build_model -> load_weights gives the transformers model's logits."""
    from model_harness import prompt_logits

    from engine.executor.kv_cache import KVCache
    from engine.loader.model_loader import load_model

    model = _tiny_model(arch, tie=arch != "qwen2")
    model.generation_config.eos_token_id = [2, 3]
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu")
    assert loaded.source.kind == "safetensors" and loaded.tokenizer is None
    assert loaded.config.eos_token_ids == (2, 3)  # merged from generation_config.json
    assert loaded.generation_defaults["eos_token_id"] == [2, 3]
    c = loaded.config
    kv = KVCache(c.num_hidden_layers, num_blocks=16, block_size=4, num_kv_heads=c.num_key_value_heads,
                 head_dim=c.head_dim)
    prompts = [[5, 17, 42, 99, 3, 250, 7], [1, 2, 3]]
    ours = prompt_logits(loaded.model, kv, prompts)
    with torch.no_grad():
        expected = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_dummy_weights_have_the_transformers_shapes() -> None:
    for arch, cls in ARCHS.items():
        hf = _tiny_model(arch, tie=arch == "llama")
        config = ModelConfig.from_hf_dict(hf.config.to_dict())
        expected = {k: tuple(v.shape) for k, v in _expected_state(hf).items()}
        assert dict(weight_shapes(config)) == expected, cls.__name__
        weights = dict(iter_dummy_weights(config, dtype=torch.bfloat16))
        assert {k: tuple(v.shape) for k, v in weights.items()} == expected
        assert all(v.dtype == torch.bfloat16 for v in weights.values())


def test_dummy_weights_values_and_determinism() -> None:
    config = get_preset("smollm2-135m").replace(num_hidden_layers=2)
    first = dict(iter_dummy_weights(config, seed=3))
    again = dict(iter_dummy_weights(config, seed=3))
    other = dict(iter_dummy_weights(config, seed=4))
    assert all(torch.equal(first[k], again[k]) for k in first)
    emb = first["model.embed_tokens.weight"]
    assert not torch.equal(emb, other["model.embed_tokens.weight"])
    assert abs(float(emb.std()) - 0.02) < 1e-3 and abs(float(emb.mean())) < 1e-3
    assert torch.equal(first["model.norm.weight"], torch.ones(576))
    assert torch.equal(first["model.layers.1.input_layernorm.weight"], torch.ones(576))
    # each tensor has its own seed: q_proj differs from k_proj's leading rows
    q = first["model.layers.0.self_attn.q_proj.weight"]
    k = first["model.layers.0.self_attn.k_proj.weight"]
    assert not torch.equal(q[: k.shape[0]], k)


@pytest.mark.parametrize(
    ("preset", "billions"),
    [("smollm2-135m", 0.1346), ("llama-3.2-1b", 1.2355), ("llama-3-8b", 8.0302), ("qwen2.5-7b", 7.6156)],
)
def test_presets_have_the_real_parameter_counts(preset: str, billions: float) -> None:
    count = sum(torch.Size(shape).numel() for _, shape in weight_shapes(PRESETS[preset]))
    assert count / 1e9 == pytest.approx(billions, abs=5e-4)


def test_resolve_sources(tmp_path: Path, smollm2_gguf_path: Path) -> None:
    default = resolve_model("default")
    assert default.kind == "gguf" and default.path == smollm2_gguf_path
    assert default.name == "SmolLM2-135M-Instruct"
    assert resolve_model(str(smollm2_gguf_path)).kind == "gguf"
    assert resolve_model(str(smollm2_gguf_path.parent), "gguf").path == smollm2_gguf_path
    dummy = resolve_model("llama-3-8b", "dummy")
    assert dummy.kind == "dummy" and dummy.preset == "llama-3-8b" and dummy.path is None
    (tmp_path / "config.json").write_text(json.dumps(get_preset("smollm2-135m").to_hf_dict()))
    from_dir = resolve_model(str(tmp_path), "dummy")
    assert from_dir.kind == "dummy" and from_dir.path == tmp_path / "config.json"


def test_load_model_dummy_preset_with_tokenizer() -> None:
    from engine.loader.model_loader import load_model, load_tokenizer

    config = get_preset("smollm2-135m")
    loaded = load_model("smollm2-135m", load_format="dummy", dtype="bfloat16", device="cpu")
    assert loaded.config == config and loaded.dtype == torch.bfloat16
    assert loaded.tokenizer is not None and loaded.tokenizer.vocab_size == config.vocab_size
    assert loaded.chat_template is not None and loaded.source.kind == "dummy"
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    tok = load_tokenizer("default")
    assert tok.encode("Hello world") == loaded.tokenizer.encode("Hello world")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dummy_llama3_8b_in_bf16_on_gpu_needs_no_fp32_copy() -> None:
    from engine.loader.model_loader import load_model

    torch.cuda.reset_peak_memory_stats()
    loaded = load_model("llama-3-8b", load_format="dummy", dtype="auto", device="cuda")
    assert loaded.dtype == torch.bfloat16 and loaded.device.type == "cuda"
    model_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert model_bytes == pytest.approx(8.03e9 * 2, rel=0.01)
    # the weights are generated one tensor at a time on the GPU: peak = model + the largest tensor or two
    largest = 128256 * 4096 * 2
    assert torch.cuda.max_memory_allocated() <= model_bytes + 3 * largest
