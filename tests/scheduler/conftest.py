"""Helpers shared by the scheduler tests, as fixtures: a scheduler factory, scripted requests, a simulated
engine step and a batch's plan."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from scheduler import FinishReason, Request, ScheduledBatch, Scheduler, SchedulerConfig, make_scheduler

MakeScheduler = Callable[..., Scheduler]


@pytest.fixture
def make() -> MakeScheduler:
    """``make(num_blocks=16, policy="fifo", **config)``: blocks of 4 tokens and no safety margin unless
    told."""

    def make(num_blocks: int = 16, policy: str = "fifo", **kw: object) -> Scheduler:
        kw.setdefault("block_size", 4)
        kw.setdefault("safety_margin", 0.0)
        return make_scheduler(policy, SchedulerConfig(num_blocks=num_blocks, **kw))  # type: ignore[arg-type]

    return make


@pytest.fixture
def req() -> Callable[..., Request]:
    """``req(rid, prompt_len, max_new=4, start=0)``: prompt tokens ``start, start + 1, ...``."""

    def req(rid: str, prompt_len: int, max_new: int = 4, start: int = 0) -> Request:
        return Request(
            request_id=rid, prompt_ids=list(range(start, start + prompt_len)), max_new_tokens=max_new
        )

    return req


def token_for(r: Request) -> int:
    """The simulated engine's next token: a function of the request and position, so a token emitted twice
    or out of order shows up in ``output_ids``."""
    return 1000 + len(r.output_ids)


@pytest.fixture
def engine_step() -> Callable[[Scheduler, ScheduledBatch], list[Request]]:
    """``engine_step(s, batch)``: sample ``token_for`` each chunk that needs it, finish at ``max_new_tokens``,
    ``update`` and check the scheduler's integrity. Returns the finished requests."""

    def engine_step(s: Scheduler, batch: ScheduledBatch) -> list[Request]:
        new_tokens: dict[str, int] = {}
        finished: dict[str, FinishReason] = {}
        for chunk in batch.requests:
            if chunk.needs_sample:
                new_tokens[chunk.request.request_id] = token_for(chunk.request)
                if len(chunk.request.output_ids) + 1 >= chunk.request.max_new_tokens:
                    finished[chunk.request.request_id] = FinishReason.LENGTH
        done = s.update(batch, new_tokens, finished)
        s.check_integrity()
        return done

    return engine_step


@pytest.fixture
def plan() -> Callable[[ScheduledBatch], list[tuple[str, int, int]]]:
    """``plan(batch)``: (request id, start, num_tokens) of each chunk, in batch order."""

    def plan(batch: ScheduledBatch) -> list[tuple[str, int, int]]:
        return [(c.request.request_id, c.start, c.num_tokens) for c in batch.requests]

    return plan
