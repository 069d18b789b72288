"""Prompt log-probabilities through the engine's Python API on the default model, against transformers on
the same weights: each prompt token's log-probability given the tokens before it, its rank and the top
alternatives; under chunked prefill, beside other requests, after a prefix-cache hit and with n > 1."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from default_engine import engine_on

from engine.engine import CacheOptions, Engine
from engine.loader.model_loader import LoadedModel
from engine.outputs import GenerationOutput

PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "print(fibonacci(10))  # prints fifty-five, the tenth Fibonacci number, computed recursively",
    "Once upon a time",
]
TOP = 3
ATOL = 2e-3  # our float32 kernels against transformers' float32 eager path


@pytest.fixture(scope="module")
def engine(default_model: LoadedModel) -> Engine:
    return engine_on(default_model, num_blocks=256)


@pytest.fixture(scope="module")
def reference(oracle_model: Any, engine: Engine) -> list[torch.Tensor]:
    """transformers' log-probabilities of each prompt: ``[len - 1, vocab]``, row i predicting token i + 1."""
    out = []
    for text in PROMPTS:
        ids = torch.tensor([engine.tokenizer.encode(text)])
        with torch.no_grad():
            logits = oracle_model(ids).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, dim=-1))
    return out


def _check(out: GenerationOutput, ref: torch.Tensor) -> None:
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(out.prompt_ids)
    assert entries[0] is None
    for i, entry in enumerate(entries[1:]):
        assert entry is not None and entry.token_id == out.prompt_ids[i + 1]
        assert entry.logprob == pytest.approx(float(ref[i, entry.token_id]), abs=ATOL)
        better = int((ref[i] > ref[i, entry.token_id] + ATOL).sum())
        assert (
            entry.rank is not None
            and better + 1 <= entry.rank <= int((ref[i] > ref[i, entry.token_id] - ATOL).sum()) + 1
        )
        assert len(entry.top) == TOP
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
        for t, lp in entry.top:
            assert lp == pytest.approx(float(ref[i, t]), abs=ATOL)
        assert (entry.rank == 1) == (entry.top[0][0] == entry.token_id) or abs(
            entry.top[0][1] - entry.logprob
        ) < ATOL


def _run(engine: Engine, prompts: list[str], **kwargs: Any) -> list[GenerationOutput]:
    ids = [engine.tokenizer.encode(p) for p in prompts]
    outs = engine.generate_batch(ids, progress_bar=False, max_new_tokens=2, do_sample=False, **kwargs)
    return [outs[f"batch_req_{i}"] for i in range(len(prompts))]


def test_prompt_logprobs_equal_transformers(engine: Engine, reference: list[torch.Tensor]) -> None:
    for out, ref in zip(_run(engine, PROMPTS, prompt_logprobs=TOP), reference, strict=True):
        _check(out, ref)
        assert len(out.generated_ids) == 2


def test_chunked_prefill_beside_other_requests_and_after_a_cache_hit(
    engine: Engine, reference: list[torch.Tensor]
) -> None:
    chunked = Engine(engine.loaded, CacheOptions(num_blocks=256, max_batch_tokens=16), "chunked")
    long_ids = chunked.tokenizer.encode(PROMPTS[1])
    assert len(long_ids) > 3 * 16  # the long prompt arrives in several chunks
    manager = chunked.init_continuous_batching()
    manager.start()
    try:
        # the long prompt once without prompt logprobs: its blocks are now in the prefix cache
        warm = manager.add_request(long_ids, max_new_tokens=1, do_sample=False)
        while (o := manager.get_result(timeout=60)) is not None and not (
            o.request_id == warm and o.is_finished
        ):
            pass
        others = [
            manager.add_request(chunked.tokenizer.encode(p), max_new_tokens=8, do_sample=False)
            for p in PROMPTS
        ]
        rid = manager.add_request(
            long_ids, max_new_tokens=2, do_sample=False, prompt_logprobs=TOP, num_return_sequences=2
        )
        finals: dict[tuple[str, int], GenerationOutput] = {}
        while len(finals) < len(others) + 2:
            out = manager.get_result(timeout=120)
            assert out is not None
            if out.is_finished:
                finals[(out.request_id.split("/")[0], out.index)] = out
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()
    for index in (0, 1):
        _check(finals[(rid, index)], reference[1])
        assert finals[(rid, index)].num_cached_tokens == 0  # NOTE: computed, not read from the cache
    assert all(finals[(o, 0)].prompt_logprobs is None for o in others)


def test_out_of_range_prompt_logprobs_is_refused(engine: Engine) -> None:
    from engine.generation.config import GenerationConfigError

    with pytest.raises(GenerationConfigError, match="prompt_logprobs"):
        _run(engine, ["hi"], prompt_logprobs=21)
