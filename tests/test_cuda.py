"""The model and paged attention on CUDA, fp32 and bf16, against the same oracles as the CPU tests
(transformers fp32 on CPU; a float64 dense attention). Skipped without a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from model_harness import MODES, Mode, prompt_logits, run_greedy
from test_model_correctness import (
    NEW_TOKENS,
    PROMPT_LENGTHS,
    TINY_CONFIGS,
    _hf_greedy_one_by_one,
    _hf_last_logits,
    _tiny_hf_model,
)
from test_paged_attention import MIXED, run_case

from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.models import LlamaForCausalLM, build_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (9, 3)])
def test_paged_attention_fp32(heads: int, kv_heads: int) -> None:
    run_case(MIXED, heads, kv_heads, device="cuda", tol=1e-4)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_bf16(window: int | None) -> None:
    run_case(MIXED, 8, 2, dtype=torch.bfloat16, sliding_window=window, device="cuda", tol=6e-2)


def test_kv_cache_sized_from_free_gpu_memory() -> None:
    free, _ = torch.cuda.mem_get_info()
    cache = KVCache.allocate(2, 16, 2, 64, torch.bfloat16, "cuda", memory_fraction=0.01)
    assert cache.kv.is_cuda
    assert cache.nbytes <= 0.01 * free
    before = cache.kv[:, :, 0].clone()
    cache.copy_blocks([(0, 1)])
    assert torch.equal(cache.kv[:, :, 1], before)


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny(request: pytest.FixtureRequest) -> dict[str, Any]:
    hf_model = _tiny_hf_model(request.param)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, hf_model.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    return {
        "hf": hf_model,
        "config": ModelConfig.from_hf_dict(hf_model.config.to_dict()),
        "prompts": prompts,
        "ref_logits": _hf_last_logits(hf_model, prompts),
        "ref_tokens": _hf_greedy_one_by_one(hf_model, prompts),
    }


def _on_cuda(tiny: dict[str, Any], dtype: torch.dtype) -> tuple[LlamaForCausalLM, KVCache]:
    config: ModelConfig = tiny["config"]
    model = build_model(config, dtype, "cuda")
    model.load_weights(tiny["hf"].state_dict().items())
    blocks = sum(-(-(len(p) + NEW_TOKENS) // 4) for p in tiny["prompts"]) + 3
    cache = KVCache(config.num_hidden_layers, blocks, 4, config.num_key_value_heads, config.head_dim, dtype, "cuda")
    return model, cache


@pytest.mark.parametrize("mode", MODES)
def test_tiny_models_fp32(tiny: dict[str, Any], mode: Mode) -> None:
    model, cache = _on_cuda(tiny, torch.float32)
    logits = prompt_logits(model, cache, tiny["prompts"], mode).cpu()
    assert (logits - tiny["ref_logits"]).abs().max().item() <= 1e-3
    assert run_greedy(model, cache, tiny["prompts"], NEW_TOKENS, mode) == tiny["ref_tokens"]


@pytest.mark.parametrize("mode", MODES)
def test_tiny_models_bf16(tiny: dict[str, Any], mode: Mode) -> None:
    """bf16 rounds every activation: logits stay close to the fp32 oracle; greedy paths may drift apart
    after a near-tie, so only the first generated token (the argmax of those logits) is compared, where
    the oracle's margin is clear."""
    model, cache = _on_cuda(tiny, torch.bfloat16)
    logits = prompt_logits(model, cache, tiny["prompts"], mode).cpu()
    ref = tiny["ref_logits"]
    scale = ref.abs().max().item()
    assert (logits - ref).abs().max().item() <= 0.05 * scale + 0.02
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * scale
    assert torch.equal(logits.argmax(-1)[clear], ref.argmax(-1)[clear])
