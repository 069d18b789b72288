"""PrefillFirstScheduler step by step: unfinished prompt chunks before decodes, then waiting requests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from scheduler import (
    Request,
    RequestStatus,
    ScheduledBatch,
    Scheduler,
)


@pytest.fixture
def make(make: Callable[..., Scheduler]) -> Callable[..., Scheduler]:
    """The prefill_first policy, 32 blocks unless told."""

    def prefill_first(num_blocks: int = 32, **kw: object) -> Scheduler:
        return make(num_blocks, "prefill_first", **kw)

    return prefill_first


def test_prompt_chunks_go_before_decodes(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
) -> None:
    s = make(max_batch_tokens=8)
    a = req("a", 3, max_new=10)
    s.add_request(a)
    engine_step(s, s.schedule())
    assert a.status is RequestStatus.DECODING
    b = req("b", 20, max_new=2, start=100)
    s.add_request(b)
    # b is admitted after the running decode a, so it gets what a leaves: 7 tokens
    batch = s.schedule()
    assert plan(batch) == [("a", 3, 1), ("b", 0, 7)]
    engine_step(s, batch)
    assert b.status is RequestStatus.PREFILLING
    # now b's unfinished prompt comes first and takes the whole budget: a's decode waits
    batch = s.schedule()
    assert plan(batch) == [("b", 7, 8)]
    engine_step(s, batch)
    batch = s.schedule()  # b's last 5 prompt tokens, then a's decode with what is left
    assert plan(batch) == [("b", 15, 5), ("a", 4, 1)]
    engine_step(s, batch)
    assert b.output_ids == [1000] and b.status is RequestStatus.DECODING
    batch = s.schedule()  # both decode, in admission order
    assert plan(batch) == [("a", 5, 1), ("b", 20, 1)]


def test_waiting_requests_come_after_running_ones_in_arrival_order(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
) -> None:
    s = make(max_batch_tokens=10)
    for rid, n in (("a", 6), ("b", 6), ("c", 6)):
        s.add_request(req(rid, n, start=ord(rid) * 10))
    batch = s.schedule()
    assert plan(batch) == [("a", 0, 6), ("b", 0, 4)]
    engine_step(s, batch)
    batch = s.schedule()
    assert plan(batch) == [("b", 4, 2), ("a", 6, 1), ("c", 0, 6)]


def test_preemption_still_takes_the_most_recently_admitted(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
) -> None:
    s = make(num_blocks=5, max_batch_tokens=64)
    a, b = req("a", 4, max_new=6), req("b", 4, max_new=6, start=50)
    s.add_request(a)
    s.add_request(b)
    engine_step(s, s.schedule())
    assert (s.block_ids("a"), s.block_ids("b")) == ([0], [1])
    for _ in range(4):
        engine_step(s, s.schedule())
    # a and b hold 2 blocks each; a needs its 3rd with 1 free, then b needs one: b (younger) yields
    batch = s.schedule()
    assert batch.preempted_ids == ["b"] and s.block_ids("a") == [0, 2, 4]
    assert b.status is RequestStatus.WAITING and b.output_ids == [1000, 1001, 1002, 1003, 1004]
    engine_step(s, batch)
    assert a.is_finished and a.output_ids == [1000 + i for i in range(6)]
    # b recomputes prompt + its 5 tokens, then samples its 6th and last token; its 2 full blocks (freed
    # with their hashes at preemption, tail first) come back from the prefix cache: only 1 token is left
    batch = s.schedule()
    assert plan(batch) == [("b", 8, 1)]
    assert b.num_cached_tokens == 8 and s.block_ids("b")[:2] == [1, 3]
    engine_step(s, batch)
    assert b.is_finished and b.output_ids == [1000 + i for i in range(6)]
    assert s.kv_manager.num_free_blocks == 5 and not s.has_unfinished_requests()
    s.check_integrity()
