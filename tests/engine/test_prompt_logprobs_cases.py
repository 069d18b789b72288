"""Prompt log-probabilities through the Python API on the real default model against transformers'
``log_softmax(logits)`` on the same weights, at a tight tolerance: whole prompts, chunked prefill, one-token
steps (the CPU decode stack), beside other requests, beside a prefix-cache hit, preempted midway through a
prompt, n > 1, streamed; a request cancelled midway publishes none (they come only once complete), and NaN
logits in a prompt row fail that request alone, as the sampler fails a row with NaN logits."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from default_engine import engine_on
from executor_faults import faulty_executor
from torch_threads import one_torch_thread

from engine.engine import CacheOptions, Engine
from engine.loader.model_loader import LoadedModel
from engine.manager import ContinuousBatchingManager
from engine.outputs import GenerationOutput, RequestStatus, TokenLogprob
from scheduler.batch import ScheduledBatch

TOP = 5
# float32 through 30 layers, in another order of sums than transformers' (measured: at most ~1.2e-4 on
# log-probabilities of magnitude up to ~20).
ATOL, RTOL = 1e-4, 2e-5
TEXTS = [
    "The capital of France is Paris, and the capital of Germany is",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 2,  # longer than a 16-token chunk
    "Hi",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


@pytest.fixture(scope="module")
def engine(default_model: LoadedModel) -> Engine:
    return engine_on(default_model, num_blocks=256)


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    prompts = [list(engine.tokenizer.encode(t)) for t in TEXTS]
    assert len(prompts[1]) > 32 and len(prompts[2]) <= 2
    return prompts


@one_torch_thread()  # see tests/torch_threads.py
def reference(oracle_model: Any, prompt: list[int]) -> torch.Tensor:
    """transformers' log-probabilities ``[len(prompt), vocab]`` at every position of ``prompt``."""
    with torch.no_grad():
        return torch.log_softmax(oracle_model(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def oracle(oracle_model: Any, prompts: list[list[int]]) -> list[torch.Tensor]:
    return [reference(oracle_model, p) for p in prompts]


def run(
    manager: ContinuousBatchingManager, requests: list[tuple[list[int], dict[str, Any]]], timeout: float = 120
) -> list[GenerationOutput]:
    """Add every request in order, wait for all their final outputs (sample 0's), check the cache."""
    manager.start()
    try:
        ids = [manager.add_request(p, do_sample=False, ignore_eos=True, **kw) for p, kw in requests]
        finals: dict[str, GenerationOutput] = {}
        deadline = time.monotonic() + timeout
        while len(finals) < len(ids) and time.monotonic() < deadline:
            out = manager.get_result(timeout=1.0)
            if out is not None and out.is_finished and out.index == 0:
                assert out.status is RequestStatus.FINISHED, out.error
                finals[out.request_id] = out
        assert len(finals) == len(ids), "not every request finished in time"
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()
    assert manager.scheduler.kv_manager.num_free_blocks == manager.scheduler.num_blocks
    return [finals[i] for i in ids]


def check_against_oracle(
    entries: list[TokenLogprob | None] | None, prompt: list[int], ref: torch.Tensor
) -> None:
    """Each token's log-probability, rank and top alternatives as transformers gives them."""
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for t in range(1, len(prompt)):
        entry, row = entries[t], ref[t - 1]
        assert entry is not None and entry.token_id == prompt[t]
        torch.testing.assert_close(entry.logprob, row[prompt[t]].item(), atol=ATOL, rtol=RTOL)
        assert entry.rank == int((row >= row[prompt[t]]).sum())
        assert [i for i, _ in entry.top] == row.topk(TOP).indices.tolist()
        torch.testing.assert_close(
            [v for _, v in entry.top], row.topk(TOP).values.tolist(), atol=ATOL, rtol=RTOL
        )
        if entry.rank <= TOP:  # the token is among the alternatives, at its rank
            assert entry.top[entry.rank - 1][0] == prompt[t]


def assert_same(a: list[TokenLogprob | None] | None, b: list[TokenLogprob | None] | None) -> None:
    assert a is not None and b is not None and len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x is not None and y is not None
        assert (x.token_id, x.rank, [i for i, _ in x.top]) == (y.token_id, y.rank, [i for i, _ in y.top])
        torch.testing.assert_close(x.logprob, y.logprob, atol=ATOL, rtol=RTOL)


# max_batch_tokens 2048: whole prompts in one step; 16: chunked prefill; 1: one-token steps, which the CPU
# decode stack runs (its fast path must hand over every row asked for).
@pytest.mark.parametrize("max_batch_tokens", [2048, 16, 1])
def test_prompt_logprobs_equal_transformers(
    engine: Engine, prompts: list[list[int]], oracle: list[torch.Tensor], max_batch_tokens: int
) -> None:
    manager = engine.init_continuous_batching(max_batch_tokens=max_batch_tokens)
    outs = run(manager, [(p, {"max_new_tokens": 3, "prompt_logprobs": TOP}) for p in prompts])
    for out, prompt, ref in zip(outs, prompts, oracle, strict=True):
        check_against_oracle(out.prompt_logprobs, prompt, ref)
        assert len(out.generated_ids) == 3


def test_beside_other_requests_equals_alone(engine: Engine, prompts: list[list[int]]) -> None:
    """A scoring request batched with generating ones (its chunks share steps with their decodes) gets the
    scores and the tokens it gets alone, and the others are unchanged by it."""
    scored, others = prompts[1], [prompts[0], prompts[3]]
    kw = {"max_new_tokens": 8, "prompt_logprobs": 2}
    alone = run(engine.init_continuous_batching(max_batch_tokens=24), [(scored, kw)])[0]
    plain = run(
        engine.init_continuous_batching(max_batch_tokens=24), [(p, {"max_new_tokens": 20}) for p in others]
    )
    mixed = run(
        engine.init_continuous_batching(max_batch_tokens=24),
        [(others[0], {"max_new_tokens": 20}), (scored, kw), (others[1], {"max_new_tokens": 20})],
    )
    assert_same(mixed[1].prompt_logprobs, alone.prompt_logprobs)
    assert mixed[1].generated_ids == alone.generated_ids
    assert [mixed[0].generated_ids, mixed[2].generated_ids] == [o.generated_ids for o in plain]
    assert mixed[0].prompt_logprobs is None and mixed[2].prompt_logprobs is None


def test_a_scoring_request_beside_a_prefix_cache_hit(
    engine: Engine, prompts: list[list[int]], oracle: list[torch.Tensor]
) -> None:
    """The prompt's blocks are cached by an earlier request: a plain request reads them, a scoring one
    computes every position (no hit) and still scores like transformers."""
    manager = engine.init_continuous_batching()
    prompt = prompts[1]
    run(manager, [(prompt, {"max_new_tokens": 1})])  # fills the prefix cache
    hits_before = manager.scheduler.prefix_cache_hits
    plain, scored = run(
        manager, [(prompt, {"max_new_tokens": 2}), (prompt, {"max_new_tokens": 2, "prompt_logprobs": TOP})]
    )
    assert plain.num_cached_tokens > 0 and manager.scheduler.prefix_cache_hits > hits_before
    assert scored.num_cached_tokens == 0
    check_against_oracle(scored.prompt_logprobs, prompt, oracle[1])
    assert scored.generated_ids == plain.generated_ids


def test_preemption_neither_repeats_nor_loses_a_position(
    engine: Engine, prompts: list[list[int]], oracle_model: Any
) -> None:
    """12 blocks of 16 tokens, 8 tokens a step. A long scoring request ``a`` is decoding with 10 blocks when
    a second one, ``b``, starts to prefill in the 2 blocks left: ``a`` grows, ``b`` (the younger) is
    preempted midway through its prompt, then recomputes it asking only for the positions it lacks."""
    small = Engine(engine.loaded, CacheOptions(num_blocks=12, max_batch_tokens=8), "small")
    manager = small.init_continuous_batching(safety_margin=0.0)
    mid_prefill: list[str] = []

    def watch(batch: ScheduledBatch) -> None:
        for rid in batch.preempted_ids:
            request = manager.scheduler.get_request(rid)
            scores = request.payload.group.prompt_logprobs if request is not None else None
            if scores is not None and 1 < len(scores.entries) < len(request.prompt_ids):
                mid_prefill.append(rid)

    a = (prompts[3] * 8)[:150]
    b = prompts[1]
    requests = [
        (a, {"max_new_tokens": 25, "prompt_logprobs": TOP}),
        (b, {"max_new_tokens": 20, "prompt_logprobs": TOP}),
    ]
    with faulty_executor(manager, before=watch):
        outs = run(manager, requests, timeout=240)
    assert mid_prefill, "b was not preempted midway through its prompt"
    assert outs[1].num_preemptions > 0
    for out, prompt in zip(outs, (a, b), strict=True):
        check_against_oracle(out.prompt_logprobs, prompt, reference(oracle_model, prompt))
    alone = run(
        engine.init_continuous_batching(),
        [(p, {"max_new_tokens": kw["max_new_tokens"]}) for p, kw in requests],
    )
    assert [o.generated_ids for o in outs] == [o.generated_ids for o in alone]


def test_non_finite_prompt_logits_fail_only_that_request(engine: Engine, prompts: list[list[int]]) -> None:
    manager = engine.init_continuous_batching()

    def poison(batch: ScheduledBatch, logits: torch.Tensor) -> torch.Tensor:
        offset = 0
        for chunk in batch.requests:
            if chunk.num_logits_rows > 1:
                logits = logits.clone()
                logits[offset, 7] = float("nan")  # a prompt row's logits, not the sampling row's
            offset += chunk.num_logits_rows
        return logits

    manager.start()
    try:
        with faulty_executor(manager, edit=poison):
            bad = manager.add_request(prompts[1], max_new_tokens=4, prompt_logprobs=1, do_sample=False)
            good = manager.add_request(prompts[0], max_new_tokens=4, do_sample=False)
            outs = {
                o.request_id: o for o in (manager.get_result(timeout=60), manager.get_result(timeout=60)) if o
            }
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()
    assert outs[bad].status is RequestStatus.FAILED and "NaN or infinite" in (outs[bad].error or "")
    assert outs[bad].error_code is None  # the model's fault, not the request's: a 500, not a 400
    assert outs[good].status is RequestStatus.FINISHED and len(outs[good].generated_ids) == 4


def test_every_sample_of_n_gets_the_prompts_scores(
    engine: Engine, prompts: list[list[int]], oracle: list[torch.Tensor]
) -> None:
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        rid = manager.add_request(
            prompts[0], max_new_tokens=6, do_sample=True, seed=3, num_return_sequences=3, prompt_logprobs=TOP
        )
        outs = [manager.get_result(timeout=60) for _ in range(3)]
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()
    assert sorted(o.index for o in outs if o is not None and o.request_id == rid) == [0, 1, 2]
    for out in outs:
        assert out is not None and out.status is RequestStatus.FINISHED
        check_against_oracle(out.prompt_logprobs, prompts[0], oracle[0])
    assert manager.scheduler.prefix_cache_queries <= len(prompts[0])  # the prompt was computed once


def test_streamed_outputs_carry_the_scores_from_the_first(engine: Engine, prompts: list[list[int]]) -> None:
    manager = engine.init_continuous_batching(max_batch_tokens=16)
    manager.start()
    try:
        rid = manager.add_request(
            prompts[1], max_new_tokens=4, streaming=True, prompt_logprobs=0, do_sample=False
        )
        outs = list(manager.request_id_iter(rid, timeout=60))
    finally:
        manager.stop(timeout=30)
    assert outs and outs[-1].is_finished
    first = outs[0].prompt_logprobs
    assert first is not None and len(first) == len(prompts[1])
    assert all(o.prompt_logprobs is first for o in outs)  # one list, complete from the first output on
    assert all(e is None or (e.top == [] and e.rank is not None) for e in first)  # 0: the token's own only


def test_cancelling_a_scoring_request_mid_prefill_frees_everything(
    engine: Engine, prompts: list[list[int]]
) -> None:
    long_prompt = prompts[1] * 4
    manager = engine.init_continuous_batching(max_batch_tokens=4)
    manager.start()
    try:
        rid = manager.add_request(long_prompt, max_new_tokens=4, prompt_logprobs=TOP, do_sample=False)
        deadline = time.monotonic() + 30
        while manager.num_steps < 3 and time.monotonic() < deadline:  # a few chunks of 4 tokens
            time.sleep(0.005)
        manager.cancel_request(rid)
        outs = list(manager.request_id_iter(rid, timeout=30))
        assert outs and outs[-1].status is RequestStatus.CANCELLED
        assert outs[-1].prompt_logprobs is None  # never completed: nothing half-scored is published
        deadline = time.monotonic() + 10
        while manager.stats().num_requests_running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert manager.stats().kv_cache_usage == 0.0
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()
