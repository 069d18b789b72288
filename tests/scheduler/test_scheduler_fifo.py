"""FIFOScheduler step by step on scripted requests, with the engine simulated by ``update`` calls.

Also covers the machinery shared by both policies (base.py): chunked prefill, block tables, safety margin,
preemption, prefix caching, fork, finish_request, add_request validation.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from scheduler import (
    FIFOScheduler,
    FinishReason,
    PrefillFirstScheduler,
    Request,
    RequestStatus,
    RequestTooLargeError,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    make_scheduler,
)


def test_chunked_prefill_then_decode_with_exact_blocks(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
) -> None:
    s = make(num_blocks=16, max_batch_tokens=8)
    a = req("a", 18, max_new=3)
    s.add_request(a)
    assert (s.num_waiting, s.num_running) == (1, 0)

    b1 = s.schedule()
    assert plan(b1) == [("a", 0, 8)]
    assert s.block_ids("a") == [0, 1] and a.status is RequestStatus.PREFILLING
    assert not b1.requests[0].needs_sample and a.first_scheduled_time is not None
    t0 = a.first_scheduled_time
    engine_step(s, b1)
    assert a.num_computed_tokens == 8 and a.output_ids == []

    b2 = s.schedule()
    assert plan(b2) == [("a", 8, 8)] and s.block_ids("a") == [0, 1, 2, 3]
    engine_step(s, b2)

    b3 = s.schedule()  # the last 2 prompt tokens: this chunk samples
    assert plan(b3) == [("a", 16, 2)] and s.block_ids("a") == [0, 1, 2, 3, 4]
    assert b3.requests[0].needs_sample
    engine_step(s, b3)
    assert a.output_ids == [1000] and a.status is RequestStatus.DECODING

    b4 = s.schedule()  # position 18 still fits block 4
    assert plan(b4) == [("a", 18, 1)] and s.block_ids("a") == [0, 1, 2, 3, 4]
    engine_step(s, b4)
    b5 = s.schedule()
    assert plan(b5) == [("a", 19, 1)]
    done = engine_step(s, b5)
    assert done == [a] and a.status is RequestStatus.FINISHED and a.finish_reason is FinishReason.LENGTH
    assert a.output_ids == [1000, 1001, 1002]
    assert a.first_scheduled_time == t0
    assert not s.has_unfinished_requests() and s.kv_manager.num_free_blocks == 16
    assert s.kv_cache_usage() == 0.0


def test_decodes_go_first_and_prefill_takes_the_rest_of_the_budget(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
) -> None:
    s = make(num_blocks=32, max_batch_tokens=8)
    a = req("a", 3, max_new=10)
    s.add_request(a)
    engine_step(s, s.schedule())
    assert a.status is RequestStatus.DECODING
    b = req("b", 20, max_new=2, start=100)
    s.add_request(b)
    batch = s.schedule()
    assert plan(batch) == [("a", 3, 1), ("b", 0, 7)]
    engine_step(s, batch)
    batch = s.schedule()
    assert plan(batch) == [("a", 4, 1), ("b", 7, 7)]


@pytest.mark.parametrize("policy", ["fifo", "prefill_first"])
def test_max_mixed_prefill_tokens_caps_prompts_beside_decodes(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
    policy: str,
) -> None:
    """Alone, a prompt takes the whole budget; beside a decoding request, its chunks (running or newly
    admitted, together) take at most the cap, and the decode its one token."""
    s = make(num_blocks=32, max_batch_tokens=8, max_mixed_prefill_tokens=3, policy=policy)
    a = req("a", 10, max_new=10)
    s.add_request(a)
    assert plan(s.schedule()) == [("a", 0, 8)]  # nobody decodes: the whole budget
    s.finish_request("a", FinishReason.ABORT)
    a = req("a2", 3, max_new=10)
    s.add_request(a)
    engine_step(s, s.schedule())
    assert a.status is RequestStatus.DECODING
    s.add_request(req("b", 20, max_new=2, start=100))
    s.add_request(req("c", 20, max_new=2, start=200))
    batch = s.schedule()
    assert sorted(plan(batch)) == [("a2", 3, 1), ("b", 0, 3)]  # c waits: b took the 3 prompt tokens
    engine_step(s, batch)
    batch = s.schedule()
    assert sorted(plan(batch)) == [("a2", 4, 1), ("b", 3, 3)]
    with pytest.raises(ValueError, match="max_mixed_prefill_tokens"):
        SchedulerConfig(num_blocks=4, max_mixed_prefill_tokens=0)


def test_max_num_seqs_caps_the_batch(make: Callable[..., Scheduler], req: Callable[..., Request]) -> None:
    s = make(num_blocks=32, max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 2, start=10 * i))
    batch = s.schedule()
    assert [c.request.request_id for c in batch.requests] == ["r0", "r1"]
    assert (s.num_running, s.num_waiting) == (2, 1)


def test_safety_margin_holds_new_requests_back(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
) -> None:
    # 10 blocks, margin 0.2 -> 2 blocks stay free when admitting beside running requests
    s = make(num_blocks=10, safety_margin=0.2, max_batch_tokens=256)
    a, b, c = req("a", 24, max_new=2), req("b", 8, max_new=2, start=100), req("c", 4, max_new=2, start=200)
    for r in (a, b, c):
        s.add_request(r)
    batch = s.schedule()
    # a: 6 blocks (alone, no margin); b: 2 blocks leaves 2 free (ok); c: 1 block would leave 1 < 2
    assert plan(batch) == [("a", 0, 24), ("b", 0, 8)]
    assert s.num_waiting == 1 and c.status is RequestStatus.WAITING
    engine_step(s, batch)
    engine_step(s, s.schedule())  # a and b finish (max_new=2)
    assert s.num_running == 0
    assert plan(s.schedule()) == [("c", 0, 4)]


def test_a_lone_request_ignores_the_safety_margin(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
) -> None:
    s = make(num_blocks=5, safety_margin=0.5)
    s.add_request(req("a", 19, max_new=1))  # needs all 5 blocks
    assert plan(s.schedule()) == [("a", 0, 19)]


def test_preemption_picks_the_most_recently_admitted_and_completes_it_later(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
) -> None:
    # 6 blocks of 4 tokens; a, b, c admitted with 1 block each, then they grow
    s = make(num_blocks=6, max_batch_tokens=64)
    a, b, c = req("a", 4, max_new=8), req("b", 4, max_new=8, start=50), req("c", 4, max_new=8, start=90)
    for r in (a, b, c):
        s.add_request(r)
    engine_step(s, s.schedule())  # 3 blocks used, each has sampled 1 token
    assert (s.block_ids("a"), s.block_ids("b"), s.block_ids("c")) == ([0], [1], [2])
    batch = s.schedule()  # each decode needs a new block: 3 free, fine
    assert (s.block_ids("a"), s.block_ids("b"), s.block_ids("c")) == ([0, 3], [1, 4], [2, 5])
    engine_step(s, batch)
    for _ in range(3):
        engine_step(s, s.schedule())
    # a needs a 3rd block and none is free: c (admitted last) is preempted, not b
    batch = s.schedule()
    assert batch.preempted_ids == ["c"]
    assert c.status is RequestStatus.WAITING and s.block_ids("c") == [] and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and s.num_preemptions == 1
    assert s.waiting_requests[0] is c
    assert plan(batch) == [("a", 8, 1), ("b", 8, 1)]
    assert c.output_ids == [1000, 1001, 1002, 1003, 1004]  # kept for the recompute
    engine_step(s, batch)

    emitted: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for _ in range(40):
        if not s.has_unfinished_requests():
            break
        batch = s.schedule()
        before = {r.request_id: len(r.output_ids) for r in (a, b, c)}
        engine_step(s, batch)
        for r in (a, b, c):
            emitted[r.request_id].extend(r.output_ids[before[r.request_id] :])
    assert not s.has_unfinished_requests()
    for r in (a, b, c):
        assert r.output_ids == [1000 + i for i in range(8)], r.request_id  # nothing twice, nothing lost
        assert r.status is RequestStatus.FINISHED
    assert len(emitted["c"]) == 3  # only its 3 missing tokens came after the preemption
    assert s.kv_manager.num_free_blocks == 6


def test_a_gang_that_cannot_get_blocks_is_preempted_whole_and_recomputed(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
) -> None:
    # a beam search's three beams (one gang, forked from g#0) beside an older request, 6 blocks of 4
    s = make(num_blocks=6, max_batch_tokens=64)
    solo = req("solo", 4, max_new=10)
    g0 = Request(request_id="g#0", prompt_ids=list(range(50, 54)), max_new_tokens=10, gang="g")
    s.add_request(solo)
    s.add_request(g0)
    engine_step(s, s.schedule())
    beams = [g0]
    for i in (1, 2):
        child = Request(request_id=f"g#{i}", prompt_ids=list(g0.prompt_ids), max_new_tokens=10, gang="g")
        child.output_ids = list(g0.output_ids)
        beams.append(s.fork("g#0", child))
    s.check_integrity()
    # positions 4..7 fill everyone's second block; at position 8 nobody gets a third block
    for _ in range(10):
        batch = s.schedule()
        if batch.preempted_ids:
            break
        engine_step(s, batch)
    assert sorted(batch.preempted_ids) == ["g#0", "g#1", "g#2"]  # the whole gang, never some of its beams
    for beam in beams:
        assert beam.status is RequestStatus.WAITING and s.block_ids(beam.request_id) == []
        assert beam.num_computed_tokens == 0 and beam.output_ids == [1000 + i for i in range(5)]
    assert [c.request.request_id for c in batch.requests] == ["solo"]
    assert s.kv_manager.request_ids == {"solo"}
    engine_step(s, batch)
    for _ in range(60):  # recomputed once solo is done
        if not s.has_unfinished_requests():
            break
        engine_step(s, s.schedule())
    assert not s.has_unfinished_requests()
    for r in (solo, *beams):
        assert r.output_ids == [1000 + i for i in range(10)] and r.status is RequestStatus.FINISHED
    assert s.kv_manager.num_free_blocks == 6


def test_a_request_preempts_itself_when_it_was_admitted_last(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
) -> None:
    s = make(num_blocks=3, max_batch_tokens=64)
    a, b = req("a", 4, max_new=8), req("b", 4, max_new=8, start=50)
    s.add_request(a)
    s.add_request(b)
    engine_step(s, s.schedule())
    batch = s.schedule()  # a takes the last free block; b needs one and is itself the youngest
    assert batch.preempted_ids == ["b"]
    assert plan(batch) == [("a", 4, 1)]
    assert s.waiting_requests == (b,)
    engine_step(s, batch)


def test_a_victim_scheduled_earlier_in_the_step_leaves_the_batch(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
) -> None:
    # FIFO runs decodes first, so a younger decoding request can be in the batch already when an older
    # prefilling one runs out of blocks: the victim must leave the batch and give its tokens back.
    s = make(num_blocks=4, max_batch_tokens=8)
    p, x = req("p", 2, max_new=8), req("x", 12, max_new=2, start=100)
    s.add_request(p)
    s.add_request(x)
    batch = s.schedule()
    assert plan(batch) == [("p", 0, 2), ("x", 0, 6)]
    engine_step(s, batch)
    assert (s.block_ids("p"), s.block_ids("x")) == ([0], [1, 2])
    c = Request(request_id="c", prompt_ids=list(p.prompt_ids), output_ids=[7], max_new_tokens=8)
    s.fork("p", c)  # the youngest running request; copies p's partial block 0 into block 3
    assert s.block_ids("c") == [3] and c.status is RequestStatus.DECODING
    batch = s.schedule()
    assert batch.preempted_ids == ["c"]
    assert plan(batch) == [("p", 2, 1), ("x", 6, 6)]
    assert batch.blocks_to_copy == []  # c's copy is dropped with it
    assert s.block_ids("x") == [1, 2, 3] and s.kv_manager.pool.ref_count(0) == 1
    assert s.waiting_requests == (c,) and c.num_computed_tokens == 0
    s.check_integrity()
    engine_step(s, batch)


def test_finish_request_frees_blocks_of_running_and_waiting_requests(
    make: Callable[..., Scheduler], req: Callable[..., Request]
) -> None:
    s = make(num_blocks=8, max_num_seqs=1)
    a, b = req("a", 9, max_new=4), req("b", 5, max_new=4, start=50)
    s.add_request(a)
    s.add_request(b)
    batch = s.schedule()
    assert s.block_ids("a") == [0, 1, 2] and s.kv_manager.num_free_blocks == 5
    got = s.finish_request("a", FinishReason.ABORT)
    assert got is a and a.status is RequestStatus.FINISHED and a.finish_reason is FinishReason.ABORT
    assert s.block_ids("a") == [] and s.kv_manager.num_free_blocks == 8 and s.get_request("a") is None
    # the engine's update for the batch still in flight ignores the cancelled request
    assert s.update(batch, {"a": 7}, {}) == []
    assert a.output_ids == []
    assert s.finish_request("b", FinishReason.ABORT) is b and s.num_waiting == 0
    assert s.finish_request("nope", FinishReason.ABORT) is None
    s.check_integrity()


def test_prefix_cache_serves_a_repeated_prompt(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
) -> None:
    s = make(num_blocks=16)
    a = req("a", 10, max_new=1)
    s.add_request(a)
    engine_step(s, s.schedule())
    assert a.is_finished
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (10, 0)
    b = req("b", 10, max_new=2)
    s.add_request(b)
    batch = s.schedule()
    assert plan(batch) == [("b", 8, 2)]
    assert b.num_cached_tokens == 8 and s.block_ids("b")[:2] == [0, 1]
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (20, 8)
    engine_step(s, batch)
    s.check_integrity()


def test_prefix_cache_off(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
) -> None:
    s = make(num_blocks=16, enable_prefix_caching=False)
    for rid in ("a", "b"):
        s.add_request(req(rid, 10, max_new=1))
        batch = s.schedule()
        assert plan(batch) == [(rid, 0, 10)]
        engine_step(s, batch)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (0, 0)


def test_fork_shares_full_blocks_and_copies_the_partial_one(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
) -> None:
    s = make(num_blocks=8)
    p = req("p", 6, max_new=4)
    s.add_request(p)
    engine_step(s, s.schedule())
    assert s.block_ids("p") == [0, 1] and p.num_computed_tokens == 6 and p.output_ids == [1000]
    child = Request(request_id="p#1", prompt_ids=list(p.prompt_ids), output_ids=[2000], max_new_tokens=4)
    assert s.fork("p", child) is child
    assert s.block_ids(child.request_id) == [0, 2] and child.num_computed_tokens == 6
    assert child.status is RequestStatus.DECODING
    assert [s.kv_manager.pool.ref_count(b) for b in (0, 1, 2)] == [2, 2, 1]  # block 1 held until copied
    s.check_integrity()
    batch = s.schedule()
    assert batch.blocks_to_copy == [(1, 2)]
    assert plan(batch) == [("p", 6, 1), ("p#1", 6, 1)]
    assert s.kv_manager.pool.ref_count(1) == 1
    engine_step(s, batch)
    assert child.output_ids == [2000, 1001]
    assert s.schedule().blocks_to_copy == []


def test_fork_on_a_block_boundary_needs_no_copy_and_without_blocks_waits(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    engine_step: Callable[[Scheduler, ScheduledBatch], list[Request]],
) -> None:
    s = make(num_blocks=3)
    p = req("p", 8, max_new=4)
    s.add_request(p)
    engine_step(s, s.schedule())
    c1 = Request(request_id="c1", prompt_ids=list(p.prompt_ids), output_ids=[5], max_new_tokens=4)
    s.fork("p", c1)
    assert s.block_ids("c1") == [0, 1] and s.kv_manager.pool.ref_count(1) == 2
    s.check_integrity()
    batch = s.schedule()  # p and c1 both need a 3rd block; 1 is free: c1, the younger, yields
    assert batch.preempted_ids == ["c1"] and s.block_ids("p") == [0, 1, 2]
    engine_step(s, batch)
    # with no free block, a fork whose shared prefix ends inside a block goes to the waiting queue
    c2 = Request(request_id="c2", prompt_ids=list(p.prompt_ids), output_ids=[1000, 6], max_new_tokens=4)
    s.fork("p", c2)
    assert c2.status is RequestStatus.WAITING and s.block_ids("c2") == []
    assert s.waiting_requests == (c2, c1)
    s.check_integrity()
    with pytest.raises(KeyError):
        s.fork("missing", Request(request_id="x", prompt_ids=[1], max_new_tokens=1))
    with pytest.raises(ValueError, match="does not start with"):
        s.fork("p", Request(request_id="y", prompt_ids=[9] * 8, output_ids=[1], max_new_tokens=2))


def test_missing_sample_recomputes_the_last_token(
    make: Callable[..., Scheduler],
    req: Callable[..., Request],
    plan: Callable[[ScheduledBatch], list[tuple[str, int, int]]],
) -> None:
    s = make()
    a = req("a", 5, max_new=3)
    s.add_request(a)
    batch = s.schedule()
    s.update(batch, {}, {})
    assert a.num_computed_tokens == 4 and a.output_ids == []
    assert plan(s.schedule()) == [("a", 4, 1)]


def test_update_leaves_stopping_to_the_engine(
    make: Callable[..., Scheduler], req: Callable[..., Request]
) -> None:
    # the engine may keep a request that reached max_new_tokens alive (to fork its siblings first)
    s = make()
    a = req("a", 5, max_new=1)
    s.add_request(a)
    assert s.update(s.schedule(), {"a": 3}, {}) == []
    assert a.status is RequestStatus.DECODING and a.output_ids == [3]
    child = Request(request_id="a.1", prompt_ids=list(a.prompt_ids), output_ids=[4], max_new_tokens=1)
    s.fork("a", child)
    assert s.finish_request("a", FinishReason.LENGTH) is a
    assert (
        s.block_ids(child.request_id) == [0, 2] and s.kv_manager.pool.ref_count(1) == 1
    )  # the held copy source survives
    assert s.schedule().blocks_to_copy == [(1, 2)]
    s.check_integrity()


def test_add_request_rejects_what_can_never_fit(
    make: Callable[..., Scheduler], req: Callable[..., Request]
) -> None:
    s = make(num_blocks=4, max_model_len=20)
    with pytest.raises(
        RequestTooLargeError, match="need 5 KV blocks of 4 tokens, but the cache holds only 4"
    ):
        s.add_request(req("a", 15, max_new=2))
    s2 = make(num_blocks=100, max_model_len=20)
    with pytest.raises(RequestTooLargeError, match="max_model_len=20"):
        s2.add_request(req("a", 15, max_new=6))
    s.add_request(req("b", 14, max_new=2))
    with pytest.raises(ValueError, match="already in the scheduler"):
        s.add_request(req("b", 1))
    with pytest.raises(ValueError, match="empty prompt"):
        s.add_request(req("c", 0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        s.add_request(req("d", 3, max_new=0))


def test_make_scheduler_and_config_validation() -> None:
    cfg = SchedulerConfig(num_blocks=8)
    assert isinstance(make_scheduler("fifo", cfg), FIFOScheduler)
    assert isinstance(make_scheduler("prefill_first", cfg), PrefillFirstScheduler)
    with pytest.raises(ValueError, match="unknown scheduler policy 'lifo'"):
        make_scheduler("lifo", cfg)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        SchedulerConfig(num_blocks=8, max_batch_tokens=0)
    with pytest.raises(ValueError, match="safety_margin"):
        SchedulerConfig(num_blocks=8, safety_margin=-0.1)
    with pytest.raises(TypeError):
        SchedulerConfig(8)  # type: ignore[misc, call-arg]
