"""A snapshot of the engine's state, read by /metrics and /health."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float  # fraction of blocks in use by running requests, 0..1
    num_blocks: int
    block_size: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache, total
    prefix_cache_hits: int  # of which found, total
    num_preemptions: int  # total
    is_running: bool
    num_grammar_matchers: int = 0  # grammar matchers held by unfinished samples (0 when idle: none leaked)
    # speculative decoding, totals: verify chunks, their drafts, the drafts accepted, and those by position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
