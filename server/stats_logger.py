"""The server's periodic log line: every ``interval`` seconds in which the engine did something, what it
did (vLLM logs the same): requests running and waiting, the KV cache's usage, the prefix cache's hit rate,
preemptions and, when requests speculate, the mean acceptance length and acceptance rate of their drafts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from engine.stats import EngineStats

logger = logging.getLogger("cbserve.stats")

DEFAULT_INTERVAL_S = 10.0


def stats_line(now: EngineStats, before: EngineStats | None) -> str | None:
    """The line for the interval from ``before`` to ``now`` (None when nothing ran or waited in it)."""
    prev = before or EngineStats(0, 0, 0.0, now.num_blocks, now.block_size, 0, 0, 0, True)
    queries = now.prefix_cache_queries - prev.prefix_cache_queries
    drafts = now.spec_num_drafts - prev.spec_num_drafts
    busy = now.num_requests_running or now.num_requests_waiting or prev.num_requests_running
    if not busy and not queries and not drafts:
        return None
    hits = now.prefix_cache_hits - prev.prefix_cache_hits
    line = (
        f"running: {now.num_requests_running} reqs, waiting: {now.num_requests_waiting} reqs, "
        f"KV cache usage: {100 * now.kv_cache_usage:.1f}%, "
        f"prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%, "
        f"preemptions: {now.num_preemptions - prev.num_preemptions}"
    )
    if drafts:
        draft_tokens = now.spec_num_draft_tokens - prev.spec_num_draft_tokens
        accepted = now.spec_num_accepted_tokens - prev.spec_num_accepted_tokens
        line += (
            f"; speculative decoding: mean acceptance length {1 + accepted / drafts:.2f}, "
            f"acceptance rate {100 * accepted / draft_tokens if draft_tokens else 0.0:.1f}% "
            f"({accepted}/{draft_tokens} draft tokens)"
        )
    return line


async def log_stats_forever(
    read: Callable[[], EngineStats | None], interval: float = DEFAULT_INTERVAL_S
) -> None:
    """Log ``stats_line`` every ``interval`` seconds until cancelled (``read`` gives None: no engine)."""
    before: EngineStats | None = None
    while True:
        await asyncio.sleep(interval)
        now = read()
        if now is None:
            continue
        line = stats_line(now, before)
        if line is not None:
            logger.info("%s", line)
        before = now
