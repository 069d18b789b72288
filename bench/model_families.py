"""Per-token speed of each native model family against the Llama path at the same size, in one process.

    python -m bench.model_families --rounds 3 --num-seqs 1 16 --new-tokens 64

Every family gets the default model's shapes (SmolLM2-135M: 30 layers, hidden 576) with dummy weights and its
own features switched on (Granite's four multipliers, SmolLM3's NoPE layer every fourth, Phi-3's fused
checkpoint tensors, Gemma 2's soft caps and alternating windows of 64 tokens, Gemma 3's q/k norms and five
local layers of 64 tokens to one global), plus the transformers backend on the Llama shape and on two
mixture-of-experts shapes (Mixtral, Qwen3-MoE: 8 experts of half the MLP's width, 2 a token, so a token's
active work is the dense model's). The engines are loaded once and run in
turn inside every round (the same minutes of the machine for all), greedy with EOS ignored, so every run
computes the same number of tokens. Prints, per batch size, each system's median tokens/s and its ratio to
the native Llama path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.engine import Engine
from engine.loader.dummy import PRESETS
from engine.loader.model_loader import load_tokenizer

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "granite": {
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.0078125,
        "logits_scaling": 8.0,
    },
    "smollm3": {"no_rope_layer_interval": 4},
    "phi3": {},
    "gemma2": {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 64,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 64,
    },
    "gemma3_text": {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 64,
        "sliding_window": 64,
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
    },
}
# Mixture-of-experts families, through the transformers backend: 8 experts of half the dense MLP's width,
# 2 a token, so a token's active multiply-adds equal the dense Llama's (4x its MLP weights in all).
MOE_FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 768},
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "head_dim": 64,
    },
}
CLASSES = {
    "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def family_config(family: str) -> dict[str, Any]:
    """The default model's shape as a ``config.json`` of ``family``."""
    base = PRESETS["smollm2-135m"].to_hf_dict()
    if family == "llama":
        return base
    extra = FAMILIES[family] if family in FAMILIES else MOE_FAMILIES[family]
    return {**base, "architectures": [CLASSES[family]], "model_type": family, **extra}


def load(family: str, folder: Path, model_impl: str) -> Engine:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(family_config(family)))
    load_tokenizer("default").save(folder)  # the default model's: its ids fit the shape's vocabulary
    return Engine.from_pretrained(
        str(folder / "config.json"), load_format="dummy", device="cpu", dtype="float32",
        model_impl=model_impl, num_blocks=512,
    )  # fmt: skip


def tokens_per_second(engine: Engine, num_seqs: int, new_tokens: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 40000, (128,), generator=gen).tolist() for _ in range(num_seqs)]
    start = time.perf_counter()
    engine.generate_batch(
        prompts, progress_bar=False, max_new_tokens=new_tokens, do_sample=False, ignore_eos=True
    )
    return num_seqs * new_tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-backend", action="store_true", help="skip the transformers backend")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        systems = {name: load(name, Path(tmp) / name, "native") for name in FAMILIES}
        if not args.no_backend:
            systems["llama (transformers backend)"] = load("llama", Path(tmp) / "backend", "transformers")
            for name in MOE_FAMILIES:
                systems[f"{name} (transformers backend)"] = load(name, Path(tmp) / name, "transformers")
        for engine in systems.values():
            tokens_per_second(engine, 2, 4, seed=0)  # warm-up: kernels built, first allocations made
        results: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            for n in args.num_seqs:
                for name, engine in systems.items():
                    results.setdefault((name, n), []).append(tokens_per_second(engine, n, args.new_tokens, r))
    print("| sequences | system | tok/s (median) | vs native llama |")
    print("|---|---|---|---|")
    for n in args.num_seqs:
        base = statistics.median(results[("llama", n)])
        for name in systems:
            tps = statistics.median(results[(name, n)])
            print(f"| {n} | {name} | {tps:.1f} | {tps / base:.2f}x |")


if __name__ == "__main__":
    main()
