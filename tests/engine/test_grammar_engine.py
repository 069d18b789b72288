"""Constrained requests in the engine loop on the real default model: preemption by recompute keeps each
sequence's matcher valid, n > 1 forks copy it, and nothing (matcher, block) outlives a request."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any

import pytest
from default_engine import engine_on
from executor_faults import faulty_executor

from engine.engine import CacheOptions, Engine
from engine.generation.grammar import GrammarMatcher
from engine.generation.grammar_spec import GrammarSpec
from engine.loader.model_loader import LoadedModel
from engine.outputs import RequestStatus
from scheduler.batch import ScheduledBatch

pytestmark = pytest.mark.slow

PATTERN = r"(alpha|beta|gamma)( [a-z]{2,6}){25,30}\."


@pytest.fixture(scope="module")
def engine(default_model: LoadedModel) -> Engine:
    return engine_on(default_model, num_blocks=256)


def test_preempted_and_forked_constrained_requests_stay_valid_and_leak_nothing(engine: Engine) -> None:
    small = Engine(engine.loaded, CacheOptions(num_blocks=12, max_batch_tokens=48), "small")
    manager = small.init_continuous_batching(safety_margin=0.0)
    manager.start()
    spec = GrammarSpec.regex(PATTERN)
    prompts = ["Say three words:", "Name a Greek letter and more", "Go"]
    try:
        ids = [
            manager.add_request(
                small.tokenizer.encode(p),
                max_new_tokens=100,
                do_sample=True,
                temperature=1.0,
                seed=i,
                num_return_sequences=2,
                structured_output=spec,
            )
            for i, p in enumerate(prompts)
        ]
        outs = []
        deadline = time.monotonic() + 300
        while len(outs) < 2 * len(ids) and time.monotonic() < deadline:
            out = manager.get_result(timeout=1.0)
            if out is not None and out.is_finished:
                outs.append(out)
        num_preemptions = manager.stats().num_preemptions
        groups = dict(manager.loop.outputs.groups)
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()
    assert len(outs) == 2 * len(ids)
    assert num_preemptions > 0, "the small cache should have preempted some sequence"
    assert not groups  # every group, and with it every matcher, is gone
    for out in outs:
        assert out.status is RequestStatus.FINISHED, out.error
        if out.finish_reason.value == "stop":
            assert re.fullmatch(PATTERN, out.text), out.text
        else:
            assert len(out.generated_ids) == 100


def test_cancelled_constrained_request_frees_its_matchers(engine: Engine) -> None:
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        rid = manager.add_request(
            engine.tokenizer.encode("Count:"),
            max_new_tokens=200,
            num_return_sequences=2,
            structured_output=GrammarSpec.regex("[0-9 ]{200}"),
            streaming=True,
        )
        first = next(manager.request_id_iter(rid, timeout=60))
        group = manager.loop.outputs.groups.get(rid)
        sequences = list(group.sequences) if group is not None else []
        manager.cancel_request(rid)
        finals = [o for o in manager.request_id_iter(rid, timeout=60) if o.is_finished]
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()
    assert first.request_id == rid
    assert [o.status for o in finals] == [RequestStatus.CANCELLED] * len(finals)
    assert sequences and all(seq.gen.grammar is None for seq in sequences)
    assert rid not in manager.loop.outputs.groups


def test_masks_are_computed_while_the_forward_runs(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each constrained step's masks are filled on the worker thread before that step's forward returns:
    the forward below waits for the mask and would time out if the sampler computed it afterwards."""
    filled = threading.Event()
    threads: set[str] = set()
    inner_fill = GrammarMatcher.fill_bitmask

    def spy(self: GrammarMatcher, *args: Any, **kwargs: Any) -> None:
        threads.add(threading.current_thread().name)
        inner_fill(self, *args, **kwargs)
        filled.set()

    monkeypatch.setattr(GrammarMatcher, "fill_bitmask", spy)
    overlapped: list[bool] = []

    def wait_for_masks(batch: ScheduledBatch) -> None:
        if any(chunk.needs_sample for chunk in batch.requests) and (not overlapped or overlapped[-1]):
            overlapped.append(filled.wait(timeout=10))
            filled.clear()

    manager = engine.init_continuous_batching()
    manager.start()
    try:
        with faulty_executor(manager, before=wait_for_masks):
            manager.add_request(
                engine.tokenizer.encode("Pick one:"),
                max_new_tokens=8,
                structured_output=GrammarSpec.choice(["alpha beta gamma delta"]),
            )
            out = None
            deadline = time.monotonic() + 120
            while (out is None or not out.is_finished) and time.monotonic() < deadline:
                out = manager.get_result(timeout=1.0)
    finally:
        manager.stop(timeout=30)
    assert out is not None and out.status is RequestStatus.FINISHED, out
    assert out.text == "alpha beta gamma delta"
    assert overlapped and all(overlapped), overlapped
    assert threads and all(name.startswith("cbserve-grammar-masks") for name in threads), threads
    manager.check_integrity()


def test_the_async_api_takes_the_grammar_compiled_off_its_event_loop(engine: Engine) -> None:
    """``submit`` (the server's path) refuses a constrained config without its compiled grammar, so that it
    can never compile on the event loop; ``await compile_grammar`` then ``submit`` serves it."""
    manager = engine.init_continuous_batching()
    manager.start()
    spec = GrammarSpec.regex("[0-9]{3}")
    config = engine.generation_defaults.merged(structured_output=spec, max_new_tokens=8, do_sample=False)
    prompt = engine.tokenizer.encode("Three digits:")

    async def main() -> str:
        with pytest.raises(ValueError, match="compile_grammar"):
            manager.submit(prompt, config)
        grammar = await manager.compile_grammar(spec)
        text = ""
        async for out in manager.submit(prompt, config, grammar=grammar):
            text = out.text
        return text

    try:
        text = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()
    assert re.fullmatch("[0-9]{3}", text), text
