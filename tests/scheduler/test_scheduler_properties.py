"""Property test of both scheduler policies against a simulated engine with a simulated KV cache.

Random arrivals, prompt lengths (sharing prefixes, so the prefix cache hits), max_new_tokens,
cancellations (also between ``schedule`` and ``update``), forks, tiny caches, prefix caching on and off.
After every step: no budget exceeded, ``check_integrity()`` holds, no block written this step is shared
with another running request, and every KV slot a request reads holds that request's token (so prefix
hits, fork copies and recomputes after preemption serve the right KV). At the end: every request not
cancelled finished with exactly ``max_new_tokens`` tokens, none emitted twice, and the pool is idle.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler import (
    FinishReason,
    Request,
    RequestStatus,
    RequestTooLargeError,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    make_scheduler,
)

MAX_STEPS = 3000


def token_for(request_id: str, index: int) -> int:
    """The simulated engine's ``index``-th generated token of a request: differs between requests."""
    return 500 + (zlib.crc32(request_id.encode()) + 7 * index) % 97


@dataclass(frozen=True)
class Arrival:
    step: int
    base: int  # which shared prompt the prompt is a prefix of
    prompt_len: int
    max_new_tokens: int


@dataclass(frozen=True)
class Event:
    step: int
    target: int  # index into the arrivals
    kind: str  # "cancel", "cancel_in_flight" (between schedule and update) or "fork"
    keep: int  # fork: how many of the parent's generated tokens the child starts with (at most)


@dataclass(frozen=True)
class Scenario:
    policy: str
    config: SchedulerConfig
    bases: list[list[int]]
    arrivals: list[Arrival]
    events: list[Event]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    bases = [draw(st.lists(st.integers(0, 9), min_size=16, max_size=16)) for _ in range(2)]
    arrivals = draw(
        st.lists(
            st.builds(
                Arrival,
                step=st.integers(0, 6),
                base=st.integers(0, 1),
                prompt_len=st.integers(1, 16),
                max_new_tokens=st.integers(1, 8),
            ),
            min_size=2,
            max_size=10,
        )
    )
    events = [
        Event(step=arrivals[target].step + delay, target=target, kind=kind, keep=keep)
        for target, delay, kind, keep in draw(
            st.lists(
                st.tuples(
                    st.integers(0, len(arrivals) - 1),
                    st.integers(0, 6),
                    st.sampled_from(["cancel", "cancel_in_flight", "fork", "fork", "fork"]),
                    st.integers(0, 6),
                ),
                max_size=5,
            )
        )
    ]
    block_size = draw(st.sampled_from([1, 2, 4, 4]))
    # A tight cache: the largest request fits (usually), a few of them at once do not.
    largest = max(-(-(a.prompt_len + a.max_new_tokens) // block_size) for a in arrivals)
    config = SchedulerConfig(
        num_blocks=max(1, largest + draw(st.integers(-1, 6))),
        block_size=block_size,
        max_batch_tokens=draw(st.integers(1, 24)),
        max_num_seqs=draw(st.integers(1, 5)),
        safety_margin=draw(st.sampled_from([0.0, 0.0, 0.2, 0.5])),
        enable_prefix_caching=draw(st.booleans()),
    )
    return Scenario(draw(st.sampled_from(["fifo", "prefill_first"])), config, bases, arrivals, events)


class FakeKV:
    """What each KV slot holds: the token whose K/V was written there."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def run(self, batch: ScheduledBatch) -> None:
        for src, dst in batch.blocks_to_copy:
            self.slots[dst] = list(self.slots[src])
        for chunk in batch.requests:
            tokens = chunk.request.all_token_ids
            for pos in range(chunk.start, chunk.end):
                block = chunk.block_ids[pos // self.block_size]
                self.slots[block][pos % self.block_size] = tokens[pos]
        # attention of each chunk reads every position up to its end
        for chunk in batch.requests:
            tokens = chunk.request.all_token_ids
            read = [
                self.slots[chunk.block_ids[p // self.block_size]][p % self.block_size]
                for p in range(chunk.end)
            ]
            assert read == tokens[: chunk.end], f"{chunk.request.request_id} reads the wrong KV"


def check_batch(s: Scheduler, batch: ScheduledBatch) -> None:
    s_config = s.config
    bs = s_config.block_size
    assert batch.num_tokens <= s_config.max_batch_tokens
    assert len(batch) <= s_config.max_num_seqs
    ids = [c.request.request_id for c in batch.requests]
    assert len(set(ids)) == len(ids)
    assert not set(ids) & set(batch.preempted_ids)
    for chunk in batch.requests:
        req = chunk.request
        assert (
            chunk.num_tokens >= 1 and chunk.start == req.num_computed_tokens and chunk.end <= req.num_tokens
        )
        assert chunk.block_ids == s.block_ids(req.request_id)
        assert len(chunk.block_ids) * bs >= chunk.end
        written = {chunk.block_ids[p // bs] for p in range(chunk.start, chunk.end)}
        for other in s.running_requests:
            if other is not req:
                assert not written & set(s.block_ids(other.request_id)), (
                    f"{req.request_id} writes a block it shares"
                )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_schedulers_keep_their_invariants(sc: Scenario) -> None:
    s = make_scheduler(sc.policy, sc.config)
    kv = FakeKV(sc.config.num_blocks, sc.config.block_size)
    requests: list[Request | None] = []  # by arrival index; None when rejected as too large
    by_step: dict[int, list[int]] = {}
    for i, a in enumerate(sc.arrivals):
        by_step.setdefault(a.step, []).append(i)
    cancelled: set[str] = set()
    children: list[tuple[Request, int]] = []  # (child, number of output tokens it was forked with)
    last_arrival = max(a.step for a in sc.arrivals)

    pending = list(sc.events)
    copies = 0
    step = 0
    while step <= last_arrival or s.has_unfinished_requests():
        assert step < MAX_STEPS, "the scheduler stopped making progress"
        for i in by_step.get(step, []):
            a = sc.arrivals[i]
            r = Request(f"r{i}", sc.bases[a.base][: a.prompt_len], a.max_new_tokens)
            try:
                s.add_request(r)
                requests.append(r)
            except RequestTooLargeError:
                assert a.prompt_len + a.max_new_tokens > sc.config.num_blocks * sc.config.block_size
                requests.append(None)
        in_flight: list[str] = []
        for ev in list(pending):
            if ev.step > step or ev.target >= len(requests) or requests[ev.target] is None:
                continue
            target = requests[ev.target]
            assert target is not None
            if target.is_finished:
                pending.remove(ev)
                continue
            if ev.kind == "fork" and target.status is RequestStatus.WAITING and step < ev.step + 8:
                continue  # NOTE: a fork waits (a while) for its parent to run, to share its blocks
            pending.remove(ev)
            if ev.kind == "cancel":
                assert s.finish_request(target.request_id, FinishReason.ABORT) is target
                cancelled.add(target.request_id)
            elif ev.kind == "cancel_in_flight":
                in_flight.append(target.request_id)
            else:
                child = Request(
                    f"{target.request_id}.{len(children)}",
                    list(target.prompt_ids),
                    target.max_new_tokens,
                    output_ids=target.output_ids[: ev.keep],
                )
                if len(child.output_ids) >= child.max_new_tokens:
                    continue
                s.fork(target.request_id, child)
                children.append((child, len(child.output_ids)))
        s.check_integrity()

        batch = s.schedule()
        check_batch(s, batch)
        s.check_integrity()
        kv.run(batch)
        copies += len(batch.blocks_to_copy)
        for rid in in_flight:
            if s.finish_request(rid, FinishReason.ABORT) is not None:
                cancelled.add(rid)
        new_tokens: dict[str, int] = {}
        finished: dict[str, FinishReason] = {}
        for chunk in batch.requests:
            r = chunk.request
            if chunk.needs_sample and not r.is_finished:
                new_tokens[r.request_id] = token_for(r.request_id, len(r.output_ids))
                if len(r.output_ids) + 1 >= r.max_new_tokens:
                    finished[r.request_id] = FinishReason.LENGTH
        done = s.update(batch, new_tokens, finished)
        assert {r.request_id for r in done} == set(finished)
        s.check_integrity()
        assert 0.0 <= s.kv_cache_usage() <= 1.0
        step += 1

    event(f"preempted: {s.num_preemptions > 0}")
    event(f"prefix cache hit: {s.prefix_cache_hits > 0}")
    event(f"fork copied a block: {copies > 0}")
    assert s.num_waiting == s.num_running == 0
    assert s.kv_manager.num_free_blocks == sc.config.num_blocks and s.kv_cache_usage() == 0.0
    assert s.prefix_cache_hits <= s.prefix_cache_queries
    if not sc.config.enable_prefix_caching:
        assert s.prefix_cache_queries == 0 and s.kv_manager.pool.num_cached_blocks == 0
    first_generated = {r.request_id: 0 for r in requests if r is not None}
    first_generated.update({c.request_id: n for c, n in children})
    for r in [r for r in requests if r is not None] + [c for c, _ in children]:
        assert r.status is RequestStatus.FINISHED
        if r.request_id in cancelled:
            assert r.finish_reason is FinishReason.ABORT and len(r.output_ids) <= r.max_new_tokens
        else:
            assert r.finish_reason is FinishReason.LENGTH
            assert len(r.output_ids) == r.max_new_tokens
        start = first_generated[r.request_id]
        generated = r.output_ids[start:]
        assert generated == [token_for(r.request_id, start + i) for i in range(len(generated))]


@given(
    prompt=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    output=st.lists(st.integers(10, 19), max_size=6),
    data=st.data(),
)
def test_token_ids_between_is_the_slice_of_all_token_ids(
    prompt: list[int], output: list[int], data: st.DataObject
) -> None:
    """A step's chunk of a request's tokens, read without concatenating prompt and output: any range."""
    req = Request("r", prompt, max_new_tokens=8, output_ids=output)
    n = len(prompt) + len(output)
    start = data.draw(st.integers(0, n))
    end = data.draw(st.integers(start, n))
    assert req.token_ids_between(start, end) == req.all_token_ids[start:end]
