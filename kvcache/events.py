"""KV-cache events: what a KV-aware router needs to mirror which blocks a replica holds in its prefix cache.

The same three events as vLLM's (``vllm/distributed/kv_events.py``), which llm-d's KV-cache manager and
other routers consume: a run of full blocks entered the prefix cache, blocks left it, the whole cache was
cleared. Replaying a replica's events in order over an empty set gives exactly the hashes its ``BlockPool``
has registered. Hashes are the ints of ``kvcache/prefix_hash.py``; the publisher chooses their wire form.

Recording is opt-in (``KVCacheManager(record_events=True)``): the pool and the manager append to one plain
list as they change the cache, and the engine takes it once per step (``KVCacheManager.take_events``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Full blocks newly registered in the prefix cache, in token order: ``block_hashes[0]`` follows the
    block hashed ``parent_block_hash`` (None: it is the request's first block), and the blocks hold
    ``token_ids`` (``block_size`` each)."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks dropped from the prefix cache (evicted for reuse, rolled back, or evicted on request)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every block left the prefix cache at once."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def replay(events: list[KVCacheEvent], cached: set[int] | None = None) -> set[int]:
    """The set of cached block hashes after ``events``, starting from ``cached`` (empty by default): what a
    subscriber holds for one replica."""
    state = set() if cached is None else cached
    for event in events:
        if isinstance(event, BlockStored):
            state.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            state.difference_update(event.block_hashes)
        else:
            state.clear()
    return state
