"""Every generation option is per request: requests with different options share one batch, and each gets
exactly what it gets alone (greedy) or with the same seed (sampled), through the real model."""

from __future__ import annotations

import time
from typing import Any

import pytest
from default_engine import engine_on

from engine.engine import Engine
from engine.loader.model_loader import LoadedModel
from engine.outputs import GenerationOutput, RequestStatus
from scheduler.request import FinishReason

pytestmark = pytest.mark.slow  # the real model, float32

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea:",
    "def add(a, b):",
    "List three fruits:",
    "Once upon a time",
    "The weather today is",
    "My favourite colour is",
    "In the year 2050,",
]
OPTIONS: list[dict[str, Any]] = [
    {"do_sample": False},
    {"do_sample": True, "temperature": 0.8, "seed": 1},
    {"do_sample": True, "top_k": 5, "seed": 2},
    {"do_sample": True, "top_p": 0.9, "temperature": 1.2, "seed": 3},
    {"do_sample": True, "min_p": 0.1, "seed": 4},
    {"do_sample": False, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    {"do_sample": False, "logit_bias": {28: 5.0}, "no_repeat_ngram_size": 2},
    {"do_sample": True, "seed": 5, "stop_strings": [" the", "."], "output_logprobs": True, "top_logprobs": 3},
]


@pytest.fixture(scope="module")
def engine(default_model: LoadedModel) -> Engine:
    return engine_on(default_model, num_blocks=256)


def run(engine: Engine, indices: list[int]) -> dict[int, GenerationOutput]:
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        ids = {}
        for i in indices:
            prompt = engine.tokenizer.encode(PROMPTS[i])
            ids[manager.add_request(prompt, max_new_tokens=12, **OPTIONS[i])] = i
        results: dict[int, GenerationOutput] = {}
        deadline = time.monotonic() + 120
        while len(results) < len(ids) and time.monotonic() < deadline:
            out = manager.get_result(timeout=1.0)
            if out is not None and out.is_finished:
                results[ids[out.request_id]] = out
        assert len(results) == len(ids)
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()
    return results


def test_mixed_batch_equals_each_alone(engine):
    together = run(engine, list(range(len(PROMPTS))))
    for i in range(len(PROMPTS)):
        alone = run(engine, [i])[i]
        assert together[i].status is RequestStatus.FINISHED, together[i].error
        assert together[i].generated_ids == alone.generated_ids, OPTIONS[i]
        assert together[i].text == alone.text
    # the stop-string request ends before its stop string, the others ran to their length or EOS
    stopped = together[7]
    if stopped.finish_reason is FinishReason.STOP:
        assert not stopped.text.endswith((" the", "."))
    assert stopped.logprobs is not None and len(stopped.logprobs) == len(stopped.generated_ids)
    assert all(len(lp.top) == 3 for lp in stopped.logprobs)


def test_stop_string_ending_inside_a_token(engine):
    prompt = engine.tokenizer.encode("The capital of France is")
    free = engine.generate_batch([prompt], progress_bar=False, max_new_tokens=8, do_sample=False)[
        "batch_req_0"
    ]
    assert free.text.startswith(" Paris")
    out = engine.generate_batch(
        [prompt], progress_bar=False, max_new_tokens=8, do_sample=False, stop_strings=["aris"]
    )["batch_req_0"]
    assert out.finish_reason is FinishReason.STOP
    assert out.text == " P"  # cut before the stop string, which ends inside the token " Paris"
    assert out.generated_ids == free.generated_ids[: len(out.generated_ids)]
