"""The transformers backend (engine/executor/models/transformers_backend.py) end to end.

Tiny random models of many architectures, built from transformers' own config classes, each saved as a
folder (safetensors + config.json + generation_config.json + the byte tokenizer of tests/model_harness.py),
served with ``Engine.from_pretrained(folder, model_impl="transformers")``: greedy tokens equal transformers'
``generate()`` on the same folder, alone and batched, with chunked prefill, with preemption and with prefix
caching; a forward that raises inside transformers' code fails only its step; the native path equals the
backend on the same Llama weights; a non-Llama model answers over HTTP;
what cannot run is refused at start with the model and the reason. One test runs the real default model
through both paths (slow).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from default_engine import engine_on
from model_harness import TINY_BASE, save_byte_tokenizer, save_tiny

from engine.engine import Engine
from engine.errors import ModelLoadError, UnsupportedArchitectureError, UnsupportedModelError
from engine.executor.models.transformers_backend import TransformersForCausalLM
from engine.loader.model_loader import LoadedModel
from engine.manager import ContinuousBatchingManager
from engine.outputs import GenerationOutput, RequestStatus

# name -> (transformers config class, fields over TINY_BASE)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", {"attn_logit_softcapping": None, "sliding_window": 4}),  # final softcap kept
    "gemma3_text": (
        "Gemma3TextConfig",
        {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "phi3": ("Phi3Config", {"partial_rotary_factor": 0.5}),
    "granite": ("GraniteConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "stablelm": ("StableLmConfig", {"partial_rotary_factor": 0.25}),
    "gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 0.25}),
    "gpt2": ("GPT2Config", {}),
    "gpt_bigcode": ("GPTBigCodeConfig", {"multi_query": True}),
    "cohere": ("CohereConfig", {}),
    "smollm3": ("SmolLM3Config", {}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    # the native families beside Llama (engine/executor/models/llama.py), with their features switched on
    "granite_multipliers": (
        "GraniteConfig",
        {
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.35,
            "attention_multiplier": 0.09,
            "logits_scaling": 2.5,
            "attention_bias": True,
        },
    ),  # fmt: skip
    "smollm3_nope": ("SmolLM3Config", {"no_rope_layer_interval": 2}),
    "phi3_fused": ("Phi3Config", {}),
    # (and gemma3_text above) engine/executor/models/gemma.py; the backend soft-caps scores in paged attention
    "gemma2_softcap": ("Gemma2Config", {"sliding_window": 4, "attn_logit_softcapping": 0.5}),
    # head_dim 64: the CPU decode and prefill kernels run (head_dim 16 falls back to SDPA), with a window
    "gemma2_hd64": (
        "Gemma2Config",
        {
            "attn_logit_softcapping": None,
            "sliding_window": 8,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
        },
    ),  # fmt: skip
}
PROMPTS = [list(range(40, 47)), [20, 21, 22], list(range(60, 100))]  # 7, 3 and 40 tokens
MAX_NEW = 10


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-archs")
    return {name: save_tiny(root / name, cls, fields) for name, (cls, fields) in ARCHS.items()}


def reference(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy ``generate()`` of each prompt on ``folder`` (``MAX_NEW`` tokens, no EOS stop)."""
    # NOTE: eager attention soft-caps Gemma 2's scores in every transformers 5.x (5.17 ran SDPA, which did not)
    capped = getattr(transformers.AutoConfig.from_pretrained(folder), "attn_logit_softcapping", None)
    attn = {"attn_implementation": "eager"} if capped else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **attn).eval()
    return [
        model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.int64),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in prompts
    ]


@pytest.fixture(scope="module")
def oracle(folders: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {name: reference(folder, PROMPTS) for name, folder in folders.items()}


def serve(folder: Path, **options: Any) -> Engine:
    options = {"num_blocks": 64, **options}
    return Engine.from_pretrained(
        str(folder), device="cpu", dtype="float32", model_impl="transformers", **options
    )


def run(
    manager: ContinuousBatchingManager, prompts: list[list[int]], timeout: float = 120
) -> list[GenerationOutput]:
    """Every prompt greedy for ``MAX_NEW`` tokens, added at once; their final outputs in order."""
    manager.start()
    try:
        ids = [
            manager.add_request(p, max_new_tokens=MAX_NEW, do_sample=False, ignore_eos=True) for p in prompts
        ]
        finals: dict[str, GenerationOutput] = {}
        deadline = time.monotonic() + timeout
        while len(finals) < len(ids) and time.monotonic() < deadline:
            out = manager.get_result(timeout=1.0)
            if out is not None and out.is_finished:
                assert out.status is RequestStatus.FINISHED, out.error
                finals[out.request_id] = out
        assert len(finals) == len(ids), "not every request finished in time"
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()
    assert manager.scheduler.kv_manager.num_free_blocks == manager.scheduler.num_blocks
    return [finals[i] for i in ids]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equals_transformers_alone_and_batched(
    arch: str, folders: dict[str, Path], oracle: dict[str, list[list[int]]]
) -> None:
    engine = serve(folders[arch])
    assert isinstance(engine.model, TransformersForCausalLM)
    assert engine.model_config.architecture == ARCHS[arch][0].replace("Config", "ForCausalLM").replace(
        "GPT2ForCausalLM", "GPT2LMHeadModel"
    ).replace("Gemma3TextForCausalLM", "Gemma3ForCausalLM")
    alone = [run(engine.init_continuous_batching(), [p])[0].generated_ids for p in PROMPTS]
    batched = [o.generated_ids for o in run(engine.init_continuous_batching(), PROMPTS)]
    assert alone == oracle[arch]
    assert batched == oracle[arch]


def test_the_c_kernels_run_a_sliding_window_model(folders: dict[str, Path]) -> None:
    """head_dim 64: the CPU decode/prefill kernels take the attention (where a compiler is), each layer with
    its own window (Gemma 2: sliding, then full)."""
    engine = serve(folders["gemma2_hd64"])
    assert engine.model_config.sliding_windows == (8, None)
    if engine.decode_kernel is None:
        pytest.skip("no CPU attention kernel on this machine")
    assert engine.attention_backend == "cpu"


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt2", "qwen3_moe", "gemma2_hd64"])
def test_chunked_prefill_preemption_and_prefix_caching(
    arch: str, folders: dict[str, Path], oracle: dict[str, list[list[int]]]
) -> None:
    # chunked prefill: 40 prompt tokens in chunks of at most 8 beside the other sequences' decode steps
    chunked = serve(folders[arch])
    got = run(chunked.init_continuous_batching(max_batch_tokens=8), PROMPTS)
    assert [o.generated_ids for o in got] == oracle[arch]
    # preemption: five 15-token prompts fill 5 blocks of 16; each grows into a second block as it decodes
    growing = [list(range(10 * i + 3, 10 * i + 18)) for i in range(5)]
    small = serve(folders[arch], num_blocks=5)
    manager = small.init_continuous_batching(safety_margin=0.0)
    got = run(manager, growing)
    assert manager.scheduler.num_preemptions > 0
    assert [o.generated_ids for o in got] == reference(folders[arch], growing)
    # prefix caching: the 40-token prompt again reads its first two blocks from the cache
    manager = chunked.init_continuous_batching()
    first = run(manager, [PROMPTS[2]])[0]
    again = run(manager, [PROMPTS[2]])[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 32
    assert again.generated_ids == first.generated_ids == oracle[arch][2]


def test_a_forward_raising_inside_transformers_fails_only_its_step(
    folders: dict[str, Path], oracle: dict[str, list[list[int]]]
) -> None:
    """transformers' second decoder layer raises once, mid-step (the first layer's K/V already written):
    the requests of that step fail with the error, the engine keeps serving, the same prompts then give
    transformers' tokens (no half-computed block reached the prefix cache), and no block is left behind."""
    engine = serve(folders["gemma3_text"])
    assert isinstance(engine.model, TransformersForCausalLM)
    armed = [True]

    def raise_once(module: torch.nn.Module, args: Any) -> None:
        if armed:
            armed.clear()
            raise RuntimeError("injected failure in layer 1")

    hook = engine.model.hf_model.model.layers[1].register_forward_pre_hook(raise_once)
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        first = finals(manager, [add_greedy(manager, p) for p in PROMPTS])
        again = finals(manager, [add_greedy(manager, p) for p in PROMPTS])
    finally:
        manager.stop(timeout=30)
        hook.remove()
    failed = [out for out in first if out.status is RequestStatus.FAILED]
    assert failed and all("injected failure in layer 1" in str(out.error) for out in failed)
    for prompt_oracle, out in zip(oracle["gemma3_text"], first, strict=True):
        assert out in failed or out.generated_ids == prompt_oracle
    assert [out.generated_ids for out in again] == oracle["gemma3_text"]
    manager.check_integrity()
    assert manager.scheduler.kv_manager.num_free_blocks == manager.scheduler.num_blocks


def add_greedy(manager: ContinuousBatchingManager, prompt: list[int]) -> str:
    return manager.add_request(prompt, max_new_tokens=MAX_NEW, do_sample=False, ignore_eos=True)


def finals(
    manager: ContinuousBatchingManager, ids: list[str], timeout: float = 120
) -> list[GenerationOutput]:
    """The final output of each of ``ids`` (finished or failed), in order."""
    done: dict[str, GenerationOutput] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(ids) and time.monotonic() < deadline:
        out = manager.get_result(timeout=1.0)
        if out is not None and out.is_finished:
            done[out.request_id] = out
    assert len(done) == len(ids), "not every request ended in time"
    return [done[i] for i in ids]


def test_native_and_transformers_agree_on_llama_weights(folders: dict[str, Path]) -> None:
    folder = folders["llama"]
    native = Engine.from_pretrained(str(folder), device="cpu", dtype="float32", num_blocks=64)
    backend = serve(folder)
    assert not isinstance(native.model, TransformersForCausalLM)
    assert isinstance(backend.model, TransformersForCausalLM)
    assert [o.generated_ids for o in run(native.init_continuous_batching(), PROMPTS)] == [
        o.generated_ids for o in run(backend.init_continuous_batching(), PROMPTS)
    ]


NATIVE_FAMILIES = ["granite_multipliers", "smollm3_nope", "phi3_fused", "gemma2_softcap", "gemma3_text"]


@pytest.mark.parametrize("arch", NATIVE_FAMILIES)
def test_native_families_equal_transformers_and_the_backend(
    arch: str, folders: dict[str, Path], oracle: dict[str, list[list[int]]]
) -> None:
    """Granite, SmolLM3, Phi-3, Gemma 2 (soft caps, windows of 4 under prompts of up to 40 tokens) and Gemma 3
    run cbserve's own model code under ``auto`` (with the CPU fast paths): the same greedy tokens as
    transformers' ``generate()`` and as the backend, alone, batched, in prefill chunks of 8 beside decode
    steps, under preemption and from the prefix cache."""
    native = Engine.from_pretrained(str(folders[arch]), device="cpu", dtype="float32", num_blocks=64)
    assert not isinstance(native.model, TransformersForCausalLM)
    alone = [run(native.init_continuous_batching(), [p])[0].generated_ids for p in PROMPTS]
    assert alone == oracle[arch]
    assert [o.generated_ids for o in run(native.init_continuous_batching(), PROMPTS)] == oracle[arch]
    chunked = run(native.init_continuous_batching(max_batch_tokens=8), PROMPTS)
    assert [o.generated_ids for o in chunked] == oracle[arch]
    backend = serve(folders[arch])
    assert [o.generated_ids for o in run(backend.init_continuous_batching(), PROMPTS)] == oracle[arch]
    growing = [list(range(10 * i + 3, 10 * i + 18)) for i in range(5)]
    small = Engine.from_pretrained(str(folders[arch]), device="cpu", dtype="float32", num_blocks=5)
    manager = small.init_continuous_batching(safety_margin=0.0)
    got = run(manager, growing)
    assert manager.scheduler.num_preemptions > 0
    assert [o.generated_ids for o in got] == reference(folders[arch], growing)
    manager = native.init_continuous_batching()
    first, again = run(manager, [PROMPTS[2]])[0], run(manager, [PROMPTS[2]])[0]
    assert again.num_cached_tokens >= 32 and again.generated_ids == first.generated_ids == oracle[arch][2]


def test_auto_serves_native_variants_it_cannot_compute_through_the_backend(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """A Phi-3 with partial rotary embeddings, a Gemma 2 with exact GELU: families cbserve implements, in
    variants it does not: ``auto`` serves them through transformers; ``native`` refuses them, saying why."""
    gelu = save_tiny(tmp_path / "gemma2_gelu", "Gemma2Config", {"hidden_activation": "gelu"})
    for folder, reason in ((folders["phi3"], "partial rotary"), (gelu, "activation 'gelu'")):
        engine = Engine.from_pretrained(str(folder), device="cpu", num_blocks=8)
        assert isinstance(engine.model, TransformersForCausalLM)
        with pytest.raises(ModelLoadError, match=reason):
            Engine.from_pretrained(str(folder), device="cpu", model_impl="native")


def test_auto_picks_native_for_llama_and_transformers_for_the_rest(folders: dict[str, Path]) -> None:
    llama = Engine.from_pretrained(str(folders["llama"]), device="cpu", num_blocks=8)
    gemma = Engine.from_pretrained(str(folders["gemma"]), device="cpu", num_blocks=8)
    assert not isinstance(llama.model, TransformersForCausalLM)
    assert isinstance(gemma.model, TransformersForCausalLM)
    with pytest.raises(UnsupportedArchitectureError, match="GemmaForCausalLM"):
        Engine.from_pretrained(str(folders["gemma"]), device="cpu", model_impl="native")
    with pytest.raises(ValueError, match="unknown model_impl 'fast'"):
        Engine.from_pretrained(str(folders["gemma"]), device="cpu", model_impl="fast")


def test_bfloat16_logits_are_close_to_transformers(folders: dict[str, Path]) -> None:
    folder = folders["qwen3_moe"]
    engine = Engine.from_pretrained(
        str(folder), device="cpu", dtype="bfloat16", model_impl="transformers", num_blocks=8
    )
    assert engine.dtype == torch.bfloat16
    from engine.executor.inputs import BatchInputs

    prompt = PROMPTS[2]
    inputs = BatchInputs.build([prompt], [0], [[3, 1, 5]], [len(prompt)], engine.block_size)
    logits = engine.model(inputs, engine.kv_cache, engine.decode_kernel)  # [40, vocab]
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt])).logits[0]
    assert (logits - ref).abs().max().item() <= 0.05 * ref.abs().max().item() + 0.02


@pytest.mark.parametrize("name", ["gpt_neox", "llama"])
def test_dummy_weights_for_any_architecture(name: str, tmp_path: Path) -> None:
    """``load_format="dummy"``: random weights of the config's real shapes, any architecture."""
    if name == "llama":  # a bare config.json (no transformers class saved it)
        folder = tmp_path / "llama"
        save_byte_tokenizer(folder)
        (folder / "config.json").write_text(
            json.dumps({**TINY_BASE, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
        )
    else:
        folder = tmp_path / name
        config = transformers.GPTNeoXConfig(**TINY_BASE)
        config.save_pretrained(folder)
        save_byte_tokenizer(folder)
    engine = Engine.from_pretrained(
        str(folder), device="cpu", load_format="dummy", model_impl="transformers", num_blocks=16
    )
    assert isinstance(engine.model, TransformersForCausalLM)
    out = run(engine.init_continuous_batching(), PROMPTS)
    assert all(len(o.generated_ids) == MAX_NEW for o in out)


@pytest.mark.parametrize(
    ("arch", "model_impl"), [("gemma3_text", "transformers"), ("gemma2_softcap", "native")]
)
def test_a_non_llama_model_over_http(
    arch: str, model_impl: str, folders: dict[str, Path], oracle: dict[str, list[list[int]]]
) -> None:
    """Gemma 3 through the backend, Gemma 2 (soft caps, windows) on the native code: the official client's
    greedy completion is transformers' ``generate()``."""
    import openai
    from server_fixtures import serve_in_thread

    from server.app import build_app
    from server.config import ServerConfig

    engine = Engine.from_pretrained(
        str(folders[arch]), device="cpu", dtype="float32", model_impl=model_impl, num_blocks=64
    )
    assert isinstance(engine.model, TransformersForCausalLM) == (model_impl == "transformers")
    app = build_app(engine, ServerConfig(served_model_name="tiny-gemma"))
    with serve_in_thread(app, "tiny-gemma") as base_url:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny-gemma"]
        reply = client.completions.create(
            model="tiny-gemma", prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    assert reply.usage is not None and reply.usage.completion_tokens == MAX_NEW
    assert reply.choices[0].text == engine.tokenizer.decode(oracle[arch][0])


# ---------------------------------------------------------------------- refused at start
def _config_folder(folder: Path, config: Any, architectures: list[str] | None = None) -> Path:
    config.save_pretrained(folder)
    if architectures is not None:
        d = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**d, "architectures": architectures}))
    save_byte_tokenizer(folder)
    return folder


def test_unknown_encoder_decoder_and_encoder_only_models_are_refused(tmp_path: Path) -> None:
    unknown = tmp_path / "unknown"
    save_byte_tokenizer(unknown)
    (unknown / "config.json").write_text(
        json.dumps({**TINY_BASE, "model_type": "no_such_model", "architectures": ["NoSuchForCausalLM"]})
    )
    t5 = _config_folder(
        tmp_path / "t5", transformers.T5Config(vocab_size=300, d_model=32, num_layers=1, num_heads=2)
    )
    bert = _config_folder(
        tmp_path / "bert",
        transformers.BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2),
        ["BertForMaskedLM"],
    )
    cases = [
        (unknown, "'no_such_model' is unknown to the installed transformers"),
        (t5, "'t5' is an encoder-decoder model"),
        (bert, "BertForMaskedLM is not a decoder-only causal LM"),
    ]
    for folder, reason in cases:
        for load_format in ("auto", "dummy"):
            with pytest.raises(UnsupportedModelError, match=reason) as info:
                Engine.from_pretrained(str(folder), device="cpu", load_format=load_format, num_blocks=8)
            assert folder.name in str(info.value)


def test_attention_the_paged_kernels_cannot_compute_is_refused(tmp_path: Path) -> None:
    cases = [
        ("GptOssConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}, "attention sinks"),
        ("BloomConfig", {"n_head": 4}, "does not go through transformers' AttentionInterface"),
        ("FalconConfig", {"alibi": True, "head_dim": None}, "picks attention classes of its own"),
        ("Qwen3NextConfig", {}, "'linear_attention' layers"),
    ]
    for config_class, fields, reason in cases:
        folder = save_tiny(tmp_path / config_class, config_class, fields)
        with pytest.raises(UnsupportedModelError, match=reason) as info:
            Engine.from_pretrained(str(folder), device="cpu", num_blocks=8)
        assert f"Model '{config_class}' cannot be served" in str(info.value)


def test_weights_that_do_not_fit_the_config_are_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "three-layers"
    folder.mkdir()
    for f in folders["gemma"].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    d = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**d, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match="missing tensors: model.layers.2"):
        serve(folder)
    (folder / "config.json").write_text(json.dumps({**d, "intermediate_size": 96}))
    with pytest.raises(ModelLoadError, match="mis-shaped tensors"):
        serve(folder)


# ---------------------------------------------------------------------- the real default model
def test_default_model_native_equals_transformers(default_model: LoadedModel) -> None:
    """SmolLM2-135M's GGUF (dequantized) through both paths: the same greedy tokens."""
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 7300, 30, 216, 33, 28, 216, 34, 28]]
    native = engine_on(default_model, num_blocks=32)
    backend = Engine.from_pretrained("default", device="cpu", num_blocks=32, model_impl="transformers")
    assert isinstance(backend.model, TransformersForCausalLM)
    assert [o.generated_ids for o in run(native.init_continuous_batching(), prompts)] == [
        o.generated_ids for o in run(backend.init_continuous_batching(), prompts)
    ]
