"""The continuous-batching engine end to end on the real default model (CPU, fp32, greedy): batching,
chunked prefill, prefix caching and preemption never change what a request generates."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from default_engine import engine_on
from executor_faults import FaultyExecutor

from engine.engine import Engine
from engine.errors import ContextLengthExceededError, EngineDeadError, InvalidRequestError
from engine.loader.model_loader import LoadedModel
from engine.manager import ContinuousBatchingManager
from engine.outputs import RequestStatus
from scheduler.errors import RequestTooLargeError
from scheduler.fifo import FIFOScheduler
from scheduler.request import FinishReason
from scheduler.request import RequestStatus as SchedulerStatus

pytestmark = pytest.mark.slow  # the real model, float32

SHARED = (
    "You are a helpful assistant. Answer briefly and precisely, and never make up facts you do not know. "
)
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    SHARED + "What is the boiling point of water?",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    SHARED + "Name three primary colours.",
    "1, 2, 3, 4, 5,",
    "Translate to French: good morning, my friend.",
    SHARED + "Why is the sky blue? Explain it to a child in two sentences, please.",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "The quick brown fox",
    SHARED + "Write a haiku about autumn leaves.",
    "Q: What is 12 times 12?\nA:",
    "Dear Sir or Madam, I am writing to",
    SHARED + "List the planets of the solar system in order from the sun, separated by commas:",
    "In 1969, the first humans",
    "<html><body><h1>",
]
MAX_NEW = [24, 8, 16, 20, 12, 24, 10, 18, 16, 6, 22, 12, 14, 24, 9, 15]


@pytest.fixture(scope="module")
def engine(default_model: LoadedModel) -> Engine:
    return engine_on(default_model, num_blocks=512)


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    return [engine.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, greedy."""
    out = []
    for ids, n in zip(prompts, MAX_NEW, strict=True):
        res = engine.generate_batch(
            [ids], progress_bar=False, max_new_tokens=n, do_sample=False, ignore_eos=True
        )
        out.append(res["batch_req_0"].generated_ids)
    return out


def run_concurrently(
    engine: Engine, prompts: list[list[int]], **options: object
) -> tuple[list[list[int]], object]:
    manager = engine.init_continuous_batching(**options)
    manager.start()
    try:
        ids = [
            manager.add_request(p, max_new_tokens=n, do_sample=False, ignore_eos=True)
            for p, n in zip(prompts, MAX_NEW, strict=True)
        ]
        results: dict[str, list[int]] = {}
        deadline = time.monotonic() + 120
        while len(results) < len(ids) and time.monotonic() < deadline:
            out = manager.get_result(timeout=1.0)
            if out is not None and out.is_finished:
                assert out.status is RequestStatus.FINISHED, out.error
                results[out.request_id] = out.generated_ids
        assert len(results) == len(ids), "not every request finished in time"
        manager.check_integrity()
        scheduler = manager.scheduler
        return [results[i] for i in ids], scheduler
    finally:
        manager.stop(timeout=30)


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_concurrent_equals_one_at_a_time(engine, prompts, reference, policy, prefix_caching):
    got, scheduler = run_concurrently(
        engine, prompts, scheduler=policy, enable_prefix_caching=prefix_caching, max_batch_tokens=64
    )
    assert got == reference
    if prefix_caching:
        assert scheduler.prefix_cache_hits > 0  # the shared system prefix was reused


def test_prompts_beside_decodes_take_at_most_max_mixed_prefill_tokens(
    engine, prompts, reference, monkeypatch
):
    """Every step that decodes carries at most 8 prompt tokens (the rest of the 64-token budget unused
    while anyone decodes); the outputs are those of each prompt alone. (That prompts alone take the whole
    budget: tests/scheduler/test_scheduler_fifo.py; here the requests arrive while the loop runs.)"""
    steps: list[tuple[int, int]] = []  # per step: (decoding rows, prompt tokens)
    schedule = FIFOScheduler.schedule

    def recorded(self):
        batch = schedule(self)
        decodes = [c for c in batch.requests if c.request.status is SchedulerStatus.DECODING]
        steps.append(
            (len(decodes), sum(c.num_tokens for c in batch.requests) - sum(c.num_tokens for c in decodes))
        )
        return batch

    monkeypatch.setattr(FIFOScheduler, "schedule", recorded)
    got, scheduler = run_concurrently(
        engine, prompts, max_batch_tokens=64, max_mixed_prefill_tokens=8, enable_prefix_caching=False
    )
    assert scheduler.config.max_mixed_prefill_tokens == 8
    assert got == reference
    mixed = [prompt for decodes, prompt in steps if decodes and prompt]
    assert mixed and max(mixed) <= 8


def test_preemption_keeps_outputs(engine, prompts, reference):
    # 16 requests with at most ~60 tokens each need ~64 blocks of 16 at once; give the scheduler far fewer.
    small = Engine(engine.loaded, engine.options.__class__(num_blocks=16, max_batch_tokens=64), "small")
    got, scheduler = run_concurrently(small, prompts, safety_margin=0.0)
    assert scheduler.num_preemptions > 0
    assert got == reference


def test_generate_batch_progress_and_outputs(engine, prompts, reference, capsys):
    res = engine.generate_batch(
        prompts[:4], max_new_tokens=8, do_sample=False, ignore_eos=True, record_timestamps=True
    )
    err = capsys.readouterr().err
    assert "generate_batch" in err and "tok_s" in err
    for i in range(4):
        out = res[f"batch_req_{i}"]
        assert out.generated_ids == reference[i][:8]
        assert out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        assert out.timestamps is not None and len(out.timestamps) == len(out.generated_ids)
        assert out.prompt_ids == prompts[i]


def test_cancel_frees_blocks_and_reports(engine, prompts):
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        rid = manager.add_request(prompts[3], max_new_tokens=200, do_sample=False, streaming=True)
        first = manager.get_result(timeout=30)
        assert first is not None and first.status is RequestStatus.RUNNING
        manager.cancel_request(rid)
        final = None
        for out in manager.request_id_iter(rid, timeout=30):
            final = out
        assert final is not None and final.status is RequestStatus.CANCELLED
        assert final.finish_reason is FinishReason.ABORT
        assert len(final.generated_ids) < 200
        deadline = time.monotonic() + 10
        while manager.stats().num_requests_running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert manager.stats().kv_cache_usage == 0.0
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()


def test_forward_failure_fails_only_that_step(engine, prompts, reference):
    manager = engine.init_continuous_batching()
    fired = threading.Event()

    def boom(batch):
        if not fired.is_set():
            fired.set()
            raise RuntimeError("injected fault")

    manager.executor = FaultyExecutor(manager.executor, before=boom)
    manager.start()
    try:
        a = manager.add_request(prompts[0], max_new_tokens=4, do_sample=False, ignore_eos=True)
        out = manager.get_result(timeout=30)
        assert out is not None and out.request_id == a
        assert out.status is RequestStatus.FAILED and "injected fault" in (out.error or "")
        assert manager.is_running()
        b = manager.add_request(prompts[1], max_new_tokens=MAX_NEW[1], do_sample=False, ignore_eos=True)
        out = manager.get_result(timeout=30)
        assert out is not None and out.request_id == b and out.status is RequestStatus.FINISHED
        assert out.generated_ids == reference[1]
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()


def test_bad_requests_refused_at_add(engine, prompts):
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        with pytest.raises(ContextLengthExceededError, match="maximum context length"):
            manager.add_request([1] * (engine.max_model_len - 2), max_new_tokens=10)
        with pytest.raises(InvalidRequestError, match="vocabulary"):
            manager.add_request([engine.model_config.vocab_size + 5], max_new_tokens=2)
        with pytest.raises(InvalidRequestError, match="empty"):
            manager.add_request([], max_new_tokens=2)
    finally:
        manager.stop(timeout=30)


def test_request_larger_than_cache_refused(engine):
    small = Engine(engine.loaded, engine.options.__class__(num_blocks=16), "small")
    manager = small.init_continuous_batching()
    manager.start()
    try:  # 16 blocks of 16 tokens hold 256 tokens; this request needs 300
        with pytest.raises(RequestTooLargeError, match="never fit"):
            manager.add_request([1] * 200, max_new_tokens=100)
    finally:
        manager.stop(timeout=30)


def test_stopped_loop_fails_new_requests_at_once(engine, prompts):
    manager = engine.init_continuous_batching()
    manager.start()
    manager.stop(timeout=30)
    assert not manager.is_running()
    with pytest.raises(EngineDeadError):
        manager.add_request(prompts[0], max_new_tokens=2)


async def stream_one(
    engine: Engine, manager: ContinuousBatchingManager, prompt: list[int], max_new: int
) -> list[int]:
    """One greedy request through the asyncio API: its token ids, each delta checked against the whole."""
    handle = manager.submit(
        prompt, engine.generation_defaults.merged(max_new_tokens=max_new, do_sample=False, ignore_eos=True)
    )
    ids: list[int] = []
    async for out in handle:
        ids.extend(out.delta_ids)
        assert out.generated_ids == ids
    return ids


def test_async_stream_matches_reference(engine, prompts, reference):
    manager = engine.init_continuous_batching()
    manager.start()

    async def main() -> list[list[int]]:
        streams = (stream_one(engine, manager, prompts[i], MAX_NEW[i]) for i in range(6))
        return await asyncio.wait_for(asyncio.gather(*streams), timeout=120)

    try:
        got = asyncio.run(main())
    finally:
        manager.stop(timeout=30)
    assert got == reference[:6]


def test_async_streams_wake_the_loop_once_per_step(engine, prompts, reference):
    """Every output of a step crosses to the event loop in one wake-up, in order and complete."""
    manager = engine.init_continuous_batching()
    manager.start()
    wakeups = 0

    async def main() -> list[list[int]]:
        nonlocal wakeups
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal wakeups
            if threading.current_thread() is manager._thread:
                wakeups += 1
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign, assignment]
        streams = (stream_one(engine, manager, prompts[i], MAX_NEW[i]) for i in range(8))
        return await asyncio.wait_for(asyncio.gather(*streams), timeout=120)

    steps0 = manager.num_steps
    try:
        got = asyncio.run(main())
    finally:
        manager.stop(timeout=30)
    assert got == reference[:8]
    outputs = sum(len(ids) for ids in got)
    # one wake-up per step at most (plus the iterations that only drained the inbox), far fewer than outputs
    assert 0 < wakeups <= manager.num_steps - steps0 + 2 < outputs


@pytest.mark.parametrize(
    "search", [{}, {"num_beams": 3, "num_return_sequences": 1}], ids=["one-sample", "beams"]
)
def test_evict_request_from_cache_drops_its_blocks(engine, prompts, search):
    """Every sample's blocks: a beam search's beams were forked and pruned, so their ids have gaps."""
    prompt = prompts[13]  # long enough for several full blocks
    manager = engine.init_continuous_batching()
    manager.start()
    try:

        def run() -> int:
            before = manager.scheduler.prefix_cache_hits
            rid = manager.add_request(prompt, max_new_tokens=2, do_sample=False)
            outs = list(manager.request_id_iter(rid, timeout=60))
            assert outs and outs[-1].status is RequestStatus.FINISHED
            deadline = time.monotonic() + 10
            while manager.stats().num_requests_running and time.monotonic() < deadline:
                time.sleep(0.01)
            return manager.scheduler.prefix_cache_hits - before

        assert run() == 0  # cold
        assert run() >= engine.block_size  # the finished request's blocks were reused
        rid = manager.add_request(prompt, max_new_tokens=6, do_sample=False, **search)
        for _ in manager.request_id_iter(rid, timeout=60):
            pass
        manager.evict_request_from_cache(rid)
        assert run() == 0  # identical blocks are shared, so evicting this request's drops them all
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()
