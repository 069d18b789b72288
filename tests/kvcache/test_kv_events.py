"""KV-cache events (kvcache/events.py): replayed in order, they rebuild exactly the set of hashes the pool has
cached, through prefix hits, evictions, rollbacks, evictions by id and a reset; each event says exactly what
changed."""

from __future__ import annotations

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, replay
from kvcache.manager import KVCacheManager
from kvcache.prefix_hash import hash_full_blocks

BS = 4


def cached_hashes(m: KVCacheManager) -> set[int]:
    hashes = (m.pool.block_hash(b) for b in range(m.num_blocks))
    return {h for h in hashes if h is not None}


def computed(m: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    """Admit ``request_id`` (taking its prefix hit) and mark all its tokens computed."""
    hit = m.get_computed_blocks(request_id, tokens)
    m.allocate_slots(request_id, len(tokens), hit)
    m.cache_computed(request_id, len(tokens), lambda: tokens)


class Mirror:
    """What a subscriber holds: the replayed set, checked against the pool after every change."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.state: set[int] = set()
        self.seen: list[KVCacheEvent] = []

    def sync(self) -> list[KVCacheEvent]:
        events = self.m.take_events()
        self.seen += events
        replay(events, self.state)
        assert self.state == cached_hashes(self.m)
        return events


def test_stored_events_carry_the_hashes_parent_and_tokens_of_new_blocks_only() -> None:
    m = KVCacheManager(num_blocks=8, block_size=BS, record_events=True)
    mirror = Mirror(m)
    prompt = list(range(10))  # 2 full blocks
    h = hash_full_blocks(prompt, BS)
    computed(m, "a", prompt)
    assert mirror.sync() == [BlockStored((h[0], h[1]), None, tuple(range(8)), BS)]

    grown = [*prompt, 10, 11, 12]  # the third block fills later: its parent is the second
    m.allocate_slots("a", len(grown))
    m.cache_computed("a", len(grown), lambda: grown)
    h3 = hash_full_blocks(grown, BS)[2]
    assert mirror.sync() == [BlockStored((h3,), h[1], (8, 9, 10, 11), BS)]

    computed(m, "b", prompt)  # a prefix hit registers nothing new
    assert mirror.sync() == []
    assert m.take_events() == []


def test_a_twin_block_is_no_news_and_splits_the_run() -> None:
    m = KVCacheManager(num_blocks=12, block_size=BS, record_events=True)
    mirror = Mirror(m)
    tokens = list(range(12))
    h = hash_full_blocks(tokens, BS)
    m.allocate_slots("a", 12)
    m.allocate_slots("b", 12)
    m.cache_computed("b", 8, lambda: tokens)  # b registers blocks 0 and 1 first
    m.cache_computed("a", 4, lambda: tokens)  # a's block 0 is a twin: stays uncached
    assert mirror.sync() == [BlockStored((h[0], h[1]), None, tuple(range(8)), BS)]
    m.cache_computed("a", 12, lambda: tokens)  # a's block 1 is a twin too; its block 2 is new
    assert mirror.sync() == [BlockStored((h[2],), h[1], (8, 9, 10, 11), BS)]


def test_evictions_rollbacks_evictions_by_id_and_a_reset_are_mirrored() -> None:
    m = KVCacheManager(num_blocks=4, block_size=BS, record_events=True)
    mirror = Mirror(m)
    first, second = list(range(9)), list(range(100, 109))  # 2 full blocks + 1 token each
    computed(m, "a", first)
    m.remove("a")
    mirror.sync()
    computed(m, "b", second)  # 3 new blocks out of 4: one of a's cached blocks is evicted
    events = mirror.sync()
    assert [type(e) for e in events] == [BlockRemoved, BlockStored]

    m.truncate("b", 5)  # rolls back into its second block: its hash leaves the cache
    assert mirror.sync() == [BlockRemoved((hash_full_blocks(second, BS)[1],))]
    assert not m.reset_prefix_cache()  # b holds blocks: nothing changes
    assert mirror.sync() == []
    m.remove("b")
    assert m.evict_finished("b") == 1
    mirror.sync()
    computed(m, "c", first)
    m.remove("c")
    mirror.sync()
    assert m.reset_prefix_cache()
    assert mirror.sync() == [AllBlocksCleared()] and cached_hashes(m) == set()
    computed(m, "d", first)  # after a reset the cache fills again from nothing
    assert len(mirror.sync()) == 1 and len(mirror.state) == 2
    m.check_integrity()


def test_nothing_is_recorded_unless_asked() -> None:
    m = KVCacheManager(num_blocks=4, block_size=BS)
    computed(m, "a", list(range(9)))
    m.remove("a")
    assert m.reset_prefix_cache()
    assert m.take_events() == []
