"""n > 1 (num_return_sequences): samples of one prompt prefill once and share the prompt's KV blocks."""

from __future__ import annotations

import time

import pytest
from default_engine import engine_on

from engine.engine import CacheOptions, Engine
from engine.loader.model_loader import LoadedModel
from engine.outputs import RequestStatus

pytestmark = pytest.mark.slow  # the real model, float32


@pytest.fixture(scope="module")
def engine(default_model: LoadedModel) -> Engine:
    return engine_on(default_model, num_blocks=256)


def collect(manager, ids: list[str], timeout: float = 120) -> dict[tuple[str, int], object]:
    results = {}
    expected = {rid: n for rid, n in ids}
    total = sum(expected.values())
    deadline = time.monotonic() + timeout
    while len(results) < total and time.monotonic() < deadline:
        out = manager.get_result(timeout=1.0)
        if out is not None and out.is_finished:
            results[(out.request_id, out.index)] = out
    assert len(results) == total, "not every sample finished in time"
    return results


def test_greedy_samples_equal_single_and_share_prefill(engine):
    prompt = engine.tokenizer.encode("The three most common colours of cars are")
    single = engine.generate_batch(
        [prompt], progress_bar=False, max_new_tokens=12, do_sample=False, ignore_eos=True
    )
    ref = single["batch_req_0"].generated_ids
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        rid = manager.add_request(
            prompt, max_new_tokens=12, do_sample=False, ignore_eos=True, num_return_sequences=3
        )
        res = collect(manager, [(rid, 3)])
        # one prefill for the three samples: the prompt's tokens were computed once
        assert manager.scheduler.prefix_cache_queries <= len(prompt)
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()
    for i in range(3):
        out = res[(rid, i)]
        assert out.status is RequestStatus.FINISHED
        assert out.generated_ids == ref


def test_seeded_samples_differ_and_reproduce(engine):
    prompt = engine.tokenizer.encode("Write a word:")
    kwargs = dict(
        max_new_tokens=10, do_sample=True, temperature=1.5, seed=1234, num_return_sequences=4, ignore_eos=True
    )
    runs = []
    for _ in range(2):
        res = engine.generate_batch([prompt], progress_bar=False, **kwargs)
        runs.append(
            [res["batch_req_0"].generated_ids] + [res[f"batch_req_0/{i}"].generated_ids for i in range(1, 4)]
        )
    assert runs[0] == runs[1]
    assert len({tuple(x) for x in runs[0]}) > 1  # different streams per sample


def test_many_forks_under_preemption_never_leak(engine):
    small = Engine(engine.loaded, CacheOptions(num_blocks=20, max_batch_tokens=48), "small")
    prompts = [
        small.tokenizer.encode(t) for t in ["Hello there, my friend", "One two three four five six", "A"]
    ]
    manager = small.init_continuous_batching(safety_margin=0.0)
    manager.start()
    try:
        ids = []
        for p in prompts:
            ids.append(
                (
                    manager.add_request(
                        p, max_new_tokens=30, do_sample=False, ignore_eos=True, num_return_sequences=3
                    ),
                    3,
                )
            )
        res = collect(manager, ids)
    finally:
        manager.stop(timeout=30)
    manager.check_integrity()
    for (rid, _), n in zip(ids, [3, 3, 3], strict=True):
        outs = [res[(rid, i)] for i in range(n)]
        assert all(o.status is RequestStatus.FINISHED for o in outs), [o.error for o in outs]
        assert all(len(o.generated_ids) == 30 for o in outs)
        assert all(o.generated_ids == outs[0].generated_ids for o in outs)  # greedy: every sample the same
