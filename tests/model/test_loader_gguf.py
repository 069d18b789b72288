"""The GGUF loader yields exactly transformers' dequantized state dict for the same file (names, shapes,
values, and the un-permuted llama q/k rows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from engine.loader.gguf import (
    config_from_gguf,
    dequantize_tensor,
    gguf_to_hf_name,
    iter_gguf_weights,
    reverse_permute_qk,
)
from engine.model_config import ModelConfig


@pytest.fixture(scope="module")
def config(smollm2_reader: Any, smollm2_gguf_path: Path) -> ModelConfig:
    return config_from_gguf(smollm2_reader, str(smollm2_gguf_path))


def test_every_tensor_equals_transformers(
    smollm2_reader: Any, config: ModelConfig, oracle_gguf_weights: dict[str, torch.Tensor]
) -> None:
    ours = dict(iter_gguf_weights(smollm2_reader.tensors, config))
    # tied embeddings: no lm_head in the file, transformers re-uses embed_tokens
    expected = {k: v for k, v in oracle_gguf_weights.items() if k != "lm_head.weight"}
    assert sorted(ours) == sorted(expected)
    assert len(ours) == 1 + 9 * config.num_hidden_layers + 1  # embed, 9 per layer, final norm
    for name, tensor in ours.items():
        reference = expected[name].to(torch.float32)
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == reference.shape, name
        # both sides dequantize the same blocks in float32: expect bit equality, allow 1e-6
        if not torch.equal(tensor, reference):
            assert float((tensor - reference).abs().max()) <= 1e-6, name


def test_q_and_k_are_unpermuted(smollm2_reader: Any, config: ModelConfig) -> None:
    """Without the un-permute the q/k rows would differ from transformers'; check the inverse directly:
    re-applying llama.cpp's permutation to our q_proj gives back the raw GGUF rows."""
    raw = {t.name: t for t in smollm2_reader.tensors}
    ours = dict(
        (n, w) for n, w in iter_gguf_weights(smollm2_reader.tensors, config) if n.startswith("model.layers.0.self_attn.")
    )
    for gguf_name, hf_name, heads in (
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", config.num_attention_heads),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", config.num_key_value_heads),
    ):
        stored = dequantize_tensor(raw[gguf_name], "test")
        assert not torch.equal(stored, ours[hf_name])
        assert torch.equal(_llama_cpp_permute(ours[hf_name], heads), stored)
    v_stored = dequantize_tensor(raw["blk.0.attn_v.weight"], "test")
    assert torch.equal(v_stored, ours["model.layers.0.self_attn.v_proj.weight"])


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize(("heads", "head_dim", "cols"), [(9, 64, 5), (3, 64, 1), (4, 8, 3)])
def test_reverse_permute_inverts_llama_cpp_permute(heads: int, head_dim: int, cols: int) -> None:
    w = torch.randn(heads * head_dim, cols)
    assert torch.equal(reverse_permute_qk(_llama_cpp_permute(w, heads), heads), w)
    bias = torch.randn(heads * head_dim)
    assert torch.equal(reverse_permute_qk(_llama_cpp_permute(bias, heads), heads), bias)


def test_dtype_cast(smollm2_reader: Any, config: ModelConfig) -> None:
    name, tensor = next(iter_gguf_weights(smollm2_reader.tensors, config, dtype=torch.bfloat16))
    assert name == "model.embed_tokens.weight" and tensor.dtype == torch.bfloat16
    assert tuple(tensor.shape) == (config.vocab_size, config.hidden_size)


def test_name_mapping() -> None:
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    cases = {
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.bias": "self_attn.v_proj.bias",
        "attn_output.weight": "self_attn.o_proj.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    for gguf_suffix, hf_suffix in cases.items():
        assert gguf_to_hf_name(f"blk.17.{gguf_suffix}") == f"model.layers.17.{hf_suffix}"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    assert gguf_to_hf_name("blk.0.ffn_gate_exps.weight") is None


class _FakeTensor:
    """What dequantize_tensor reads of a GGUFReader tensor."""

    def __init__(self, name: str, qtype: GGMLQuantizationType, data: np.ndarray, rows: int, cols: int) -> None:
        self.name = name
        self.tensor_type = qtype
        self.data = data
        self.shape = np.array([cols, rows])  # GGUF ne order: fastest dimension first


@pytest.mark.parametrize(
    ("qtype", "tolerance"),
    [
        (GGMLQuantizationType.F32, 0.0),
        (GGMLQuantizationType.F16, 1e-3),
        (GGMLQuantizationType.BF16, 1e-2),
        (GGMLQuantizationType.Q8_0, 0.02),
        (GGMLQuantizationType.Q4_0, 0.2),
        (GGMLQuantizationType.Q4_1, 0.2),
    ],
)
def test_dequantize_roundtrips_quantized_values(qtype: GGMLQuantizationType, tolerance: float) -> None:
    rows, cols = 4, 256
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    if qtype is GGMLQuantizationType.F32:
        data = x
    elif qtype is GGMLQuantizationType.F16:
        data = x.astype(np.float16)
    else:
        data = quantize(x, qtype)
    w = dequantize_tensor(_FakeTensor("t", qtype, data, rows, cols), "test")
    assert tuple(w.shape) == (rows, cols)
    # errors scale with the largest magnitude in a block (|x| < ~4 here)
    assert float((w.float() - torch.from_numpy(x)).abs().max()) <= tolerance * 4


@pytest.mark.parametrize(
    "qtype",
    [
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    ],
)
def test_dequantize_matches_transformers_on_random_blocks(qtype: GGMLQuantizationType) -> None:
    """gguf-py cannot quantize K-quants, so feed random block bytes (with sane fp16 scales) to our loader
    and to transformers' independent torch dequantizer."""
    from transformers.integrations.gguf.dequant import GGML_BLOCK
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    rows, cols = 3, 512
    block_elems, block_bytes = GGML_BLOCK[int(qtype)]
    rng = np.random.default_rng(int(qtype))
    blocks = rng.integers(0, 256, size=(rows * cols // block_elems, block_bytes), dtype=np.uint8)
    # NOTE: random bytes in the fp16 scale fields can be inf/nan; overwrite every 2-byte-aligned pair that
    # decodes to a non-finite half with a small finite one so both sides compare as numbers.
    halves = blocks.view(np.float16)
    halves[~np.isfinite(halves)] = np.float16(0.5)
    data = blocks.reshape(rows, -1)
    ours = dequantize_tensor(_FakeTensor("t", qtype, data, rows, cols), "test")
    theirs = hf_dequantize(torch.from_numpy(data.reshape(-1).copy()), int(qtype)).reshape(rows, cols)
    assert tuple(ours.shape) == (rows, cols)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
