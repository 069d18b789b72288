"""bfloat16 on CPU: the same model in half the bytes stays close to the fp32 oracle (the fp32 path is
checked exactly against transformers in test_model_correctness.py); SwiGLU in one AMX call changes no bit."""

from __future__ import annotations

import pytest
import torch
from default_engine import engine_on
from model_harness import prompt_logits

from engine.executor.kernels import prepacked
from engine.executor.kernels.modules import FusedSwiGLUMLP, PackedLinear
from engine.executor.kv_cache import KVCache
from engine.executor.models.layers import GatedMLP
from engine.loader.model_loader import LoadedModel, load_model

pytestmark = pytest.mark.slow  # the real model, in float32 and bfloat16

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4, 5,",
]


def test_bfloat16_logits_track_float32(default_model: LoadedModel, default_model_bf16: LoadedModel) -> None:
    fp32, bf16 = default_model, default_model_bf16  # the session's float32 and bfloat16 loads
    assert next(bf16.model.parameters()).dtype is torch.bfloat16
    prompts = [fp32.tokenizer.encode(t) for t in TEXTS]
    cfg = fp32.config

    def logits(loaded, dtype: torch.dtype) -> torch.Tensor:
        kv = KVCache(cfg.num_hidden_layers, 64, 16, cfg.num_key_value_heads, cfg.head_dim, dtype, "cpu")
        with torch.inference_mode():
            return prompt_logits(loaded.model, kv, prompts, mode="chunked").float()

    ref, low = logits(fp32, torch.float32), logits(bf16, torch.bfloat16)
    # bf16 keeps ~3 significant digits: compare distributions, not bits
    p, q = ref.log_softmax(-1), low.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    assert (kl < 0.05).all(), kl
    assert (ref.argmax(-1) == low.argmax(-1)).all()


def test_bfloat16_prepacks_only_where_the_cpu_has_bfloat16_matmuls(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's bfloat16 reorder needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: on an AVX2-only CPU (AMD Zen 3)
    it raises, so there the matmuls stay on F.linear and the model still loads and runs."""
    cpu = torch.device("cpu")
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert prepacked.can_prepack(cpu, torch.bfloat16) == (
        native and prepacked.can_prepack(cpu, torch.float32)
    )
    monkeypatch.setattr(prepacked, "_cpu_has_bf16_matmuls", lambda: False)
    assert not prepacked.can_prepack(cpu, torch.bfloat16)
    loaded = load_model("default", dtype="bfloat16", device="cpu")
    assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())
    ids = [loaded.tokenizer.encode(TEXTS[0])]
    cfg = loaded.config
    kv = KVCache(cfg.num_hidden_layers, 8, 16, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, "cpu")
    with torch.inference_mode():
        logits = prompt_logits(loaded.model, kv, ids, mode="batched")
    assert logits.shape == (1, cfg.vocab_size) and torch.isfinite(logits).all()


def test_the_engine_gives_the_same_tokens_with_swiglu_in_one_call(
    default_model_bf16: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the Engine API on the default model in bfloat16: where the CPU has AMX-BF16 or AVX512-BF16
    every MLP takes SwiGLU's projection and gate in one call for its prefill (``FusedSwiGLUMLP``), and a batch of 40- and
    70-token prompts gives the same tokens and logprobs as with the MLP's modules run one after another."""
    engine = engine_on(default_model_bf16)  # Engine.from_pretrained("default", dtype="bfloat16")'s model
    if not any(isinstance(m, FusedSwiGLUMLP) for m in engine.model.modules()):
        pytest.skip("no AMX-BF16 tiles or AVX512-BF16 here: the MLPs stay GatedMLP")
    prompts = [[(7 * i + 13 * j) % 40_000 + 100 for j in range(40 + 30 * (i % 2))] for i in range(4)]
    kwargs = dict(max_new_tokens=4, do_sample=False, output_logprobs=True, progress_bar=False)

    def run() -> list[tuple[list[int], str]]:
        outputs = engine.generate_batch(prompts, **kwargs).values()
        return [(o.generated_ids, repr(o.logprobs)) for o in outputs]

    fused = run()
    monkeypatch.setattr(FusedSwiGLUMLP, "forward", GatedMLP.forward)
    assert run() == fused
