"""The periodic log line (server/stats_logger.py): what one interval did, nothing when the engine idled."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from engine.stats import EngineStats
from server.stats_logger import log_stats_forever, stats_line


def stats(**kw: object) -> EngineStats:
    base: dict[str, object] = dict(
        num_requests_running=0,
        num_requests_waiting=0,
        kv_cache_usage=0.0,
        num_blocks=100,
        block_size=16,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        is_running=True,
    )
    return EngineStats(**{**base, **kw})  # type: ignore[arg-type]


def test_an_idle_interval_logs_nothing() -> None:
    assert stats_line(stats(), None) is None
    assert stats_line(stats(prefix_cache_queries=5), stats(prefix_cache_queries=5)) is None


def test_a_busy_interval_logs_its_own_numbers() -> None:
    before = stats(prefix_cache_queries=100, prefix_cache_hits=50, num_preemptions=1)
    now = stats(
        num_requests_running=3,
        num_requests_waiting=1,
        kv_cache_usage=0.25,
        prefix_cache_queries=200,
        prefix_cache_hits=125,
        num_preemptions=3,
    )
    line = stats_line(now, before)
    assert line == (
        "running: 3 reqs, waiting: 1 reqs, KV cache usage: 25.0%, prefix cache hit rate: 75.0%, preemptions: 2"
    )


def test_speculation_adds_acceptance() -> None:
    before = stats(spec_num_drafts=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=20)
    now = stats(
        num_requests_running=1, spec_num_drafts=20, spec_num_draft_tokens=80, spec_num_accepted_tokens=50
    )
    line = stats_line(now, before)
    assert line is not None
    assert line.endswith(
        "speculative decoding: mean acceptance length 4.00, acceptance rate 75.0% (30/40 draft tokens)"
    )


def test_the_logging_task_logs_each_busy_interval(caplog: pytest.LogCaptureFixture) -> None:
    readings = iter([None, stats(num_requests_running=2), stats()])

    async def main() -> None:
        task = asyncio.create_task(log_stats_forever(lambda: next(readings, stats()), interval=0.01))
        await asyncio.sleep(0.2)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="cbserve.stats"):
        asyncio.run(main())
    # NOTE: only this thread's records: a server that another test left running in this process (its own
    # stats task, on its own thread) logs to the same logger
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "cbserve.stats" and r.thread == threading.get_ident()
    ]
    assert lines[0].startswith("running: 2 reqs")
    assert len(lines) == 2  # the interval after it (its requests ended) logs once more, then nothing
