"""KVCacheManager: block tables with exact ids, prefix hits, copy-on-write forks, truncate, free, evict by id
and the integrity check."""

from __future__ import annotations

import pytest

from kvcache.errors import IntegrityError, NoFreeBlocksError
from kvcache.manager import NO_PREFIX, CachedPrefix, KVCacheManager
from kvcache.prefix_hash import hash_full_blocks

BS = 4


def computed(manager: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    """Give ``request_id`` blocks for ``tokens`` and mark them all computed (their full blocks cached)."""
    manager.allocate_slots(request_id, len(tokens))
    manager.cache_computed(request_id, len(tokens), lambda: tokens)


def test_tables_grow_block_by_block_and_free_tail_first() -> None:
    m = KVCacheManager(num_blocks=6, block_size=BS)
    assert m.can_allocate_slots("a", 9)
    assert m.allocate_slots("a", 9) == [0, 1, 2]
    assert m.allocate_slots("a", 12) == []  # block 2 still has room
    assert m.allocate_slots("b", 5) == [3, 4]
    assert (m.block_table("a"), m.block_table("b"), m.block_table("c")) == ([0, 1, 2], [3, 4], [])
    assert m.usage == pytest.approx(5 / 6) and m.request_ids == {"a", "b"}
    assert m.can_allocate_slots("a", 16) and not m.can_allocate_slots("a", 17)
    assert not m.can_allocate_slots("a", 16, num_reserved_blocks=1)
    with pytest.raises(NoFreeBlocksError):
        m.allocate_slots("b", 16)
    assert m.block_table("b") == [3, 4]  # a failed allocation changes nothing
    m.free("a")
    assert m.pool.free_queue() == [5, 2, 1, 0]
    assert m.block_table("a") == [] and m.request_ids == {"b"}
    m.check_integrity()


def test_a_prefix_hit_is_found_then_taken_and_counted() -> None:
    m = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    computed(m, "a", prompt)
    assert m.block_table("a") == [0, 1, 2] and m.pool.num_cached_blocks == 2
    m.free("a")
    assert m.pool.free_queue() == [3, 4, 5, 6, 7, 2, 1, 0]

    hit = m.get_computed_blocks("b", prompt)
    assert hit == CachedPrefix(block_ids=(0, 1), num_tokens=8, num_query_tokens=10)
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (0, 0)  # looking is not taking
    assert m.pool.free_queue() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert m.allocate_slots("b", 10, hit) == [3]
    assert m.block_table("b") == [0, 1, 3]
    assert m.pool.free_queue() == [4, 5, 6, 7, 2]  # taken back out of the middle of the queue
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (10, 8)

    other = [0, 1, 2, 3, 9, 9, 9, 9, 9]  # shares only the first block
    hit = m.get_computed_blocks("c", other)
    assert hit.block_ids == (0,)
    m.allocate_slots("c", 9, hit)
    assert m.block_table("c") == [0, 4, 5] and m.pool.ref_count(0) == 2
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (19, 12)
    # a different first block misses entirely, even if the second block's tokens match
    miss = m.get_computed_blocks("d", [7, 7, 7, 7, 4, 5, 6, 7, 8])
    assert miss.block_ids == () and miss.num_query_tokens == 9
    with pytest.raises(ValueError, match="at admission only"):
        m.allocate_slots("b", 11, hit)
    m.check_integrity()


def test_the_last_token_is_never_served_from_the_cache() -> None:
    m = KVCacheManager(num_blocks=4, block_size=BS)
    computed(m, "a", list(range(8)))  # exactly 2 full blocks
    m.free("a")
    # all 8 tokens cached, yet the 8th must be computed for its logits: only 1 block comes back
    assert m.get_computed_blocks("b", list(range(8))).block_ids == (0,)
    assert m.get_computed_blocks("c", list(range(9))).block_ids == (0, 1)  # a 9th token: both usable


def test_taking_back_cached_free_blocks_counts_against_the_free_ones() -> None:
    m = KVCacheManager(num_blocks=4, block_size=BS)
    computed(m, "a", list(range(8)))
    m.free("a")
    hit = m.get_computed_blocks("b", list(range(9)))
    assert hit.block_ids == (0, 1)
    # 4 free blocks: 2 taken back + 1 new leaves 1
    assert m.can_allocate_slots("b", 9, hit, num_reserved_blocks=1)
    assert not m.can_allocate_slots("b", 9, hit, num_reserved_blocks=2)
    assert not m.can_allocate_slots("b", 17, hit)
    with pytest.raises(NoFreeBlocksError):
        m.allocate_slots("b", 17, hit)
    assert m.block_table("b") == [] and (m.prefix_cache_queries, m.pool.num_free_blocks) == (0, 4)
    m.check_integrity()


def test_prefix_caching_off() -> None:
    m = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    computed(m, "a", list(range(8)))
    m.free("a")
    assert m.get_computed_blocks("b", list(range(9))) is NO_PREFIX
    assert m.pool.num_cached_blocks == 0 and m.prefix_cache_queries == 0
    m.remove("a")
    assert m.evict_finished("a") is None  # nothing is remembered either


def test_fork_shares_full_blocks_and_copies_the_partial_one_on_write() -> None:
    m = KVCacheManager(num_blocks=5, block_size=BS)
    computed(m, "p", list(range(6)))  # [0, 1]: block 1 holds 2 tokens
    assert m.fork("p", "c", 6)
    assert m.block_table("c") == [0, 2]
    assert [m.pool.ref_count(b) for b in (0, 1, 2)] == [2, 2, 1]  # block 1 held until copied
    m.check_integrity()
    assert m.fork("p", "d", 4)  # on a block boundary: nothing to copy
    assert m.block_table("d") == [0] and m.pool.ref_count(0) == 3
    assert m.take_pending_copies(["p", "d", "c"]) == [(1, 2)]
    assert m.pool.ref_count(1) == 1
    assert m.take_pending_copies(["c"]) == []
    with pytest.raises(ValueError, match="already holds blocks"):
        m.fork("p", "c", 6)
    with pytest.raises(ValueError, match="cannot share 9 tokens"):
        m.fork("p", "e", 9)
    with pytest.raises(KeyError):
        m.fork("missing", "e", 1)
    m.check_integrity()


def test_fork_without_a_free_block_changes_nothing() -> None:
    m = KVCacheManager(num_blocks=2, block_size=BS)
    computed(m, "p", list(range(6)))
    assert not m.fork("p", "c", 6)
    assert m.block_table("c") == [] and [m.pool.ref_count(b) for b in (0, 1)] == [1, 1]
    assert m.fork("p", "c", 4)  # the full block alone needs no new one
    m.check_integrity()


def test_free_drops_a_pending_copy_and_its_hold() -> None:
    m = KVCacheManager(num_blocks=4, block_size=BS)
    computed(m, "p", list(range(6)))
    m.fork("p", "c", 6)  # c: [0, 2], copy 1 -> 2 pending
    m.free("c")
    assert m.pool.free_queue() == [3, 2]
    assert [m.pool.ref_count(b) for b in (0, 1)] == [1, 1]
    assert m.take_pending_copies(["c"]) == []
    m.check_integrity()


def test_truncate_frees_the_tail_and_unregisters_its_hashes() -> None:
    m = KVCacheManager(num_blocks=6, block_size=BS)
    tokens = list(range(10))
    computed(m, "a", tokens)  # [0, 1, 2], blocks 0 and 1 cached
    m.truncate("a", 6)
    assert m.block_table("a") == [0, 1]
    assert m.pool.free_queue() == [3, 4, 5, 2]
    assert m.pool.block_hash(0) is not None and m.pool.block_hash(1) is None  # block 1 is cut: rewritten
    # the request grows again with other tokens: block 1 is registered under the new chain
    redone = tokens[:6] + [50, 51, 52, 53]
    assert m.allocate_slots("a", 10) == [3]
    m.cache_computed("a", 10, lambda: redone)
    assert m.pool.block_hash(1) == hash_full_blocks(redone, BS)[1]
    m.truncate("a", 8)  # on a block boundary: the kept blocks keep their hashes
    assert m.block_table("a") == [0, 1] and m.pool.num_cached_blocks == 2
    m.truncate("a", 0)
    assert m.block_table("a") == [] and m.pool.num_cached_blocks == 0
    with pytest.raises(ValueError, match="truncate"):
        m.truncate("a", -1)
    m.check_integrity()


def test_truncate_keeps_what_another_table_shares() -> None:
    m = KVCacheManager(num_blocks=6, block_size=BS)
    computed(m, "p", list(range(8)))  # [0, 1], both cached
    m.fork("p", "c", 8)  # c shares [0, 1]
    with pytest.raises(ValueError, match="block 1 is shared"):
        m.truncate("c", 6)
    m.truncate("c", 4)
    assert m.block_table("c") == [0] and m.pool.ref_count(1) == 1
    assert m.pool.block_hash(1) is not None  # p still holds it, with its tokens
    m.check_integrity()


def test_truncate_past_a_pending_copy_drops_it() -> None:
    m = KVCacheManager(num_blocks=4, block_size=BS)
    computed(m, "p", list(range(6)))
    m.fork("p", "c", 6)  # c: [0, 2], copy 1 -> 2 pending
    m.truncate("c", 4)
    assert m.block_table("c") == [0] and m.pool.ref_count(1) == 1 and m.pool.ref_count(2) == 0
    assert m.take_pending_copies(["c"]) == []
    m.check_integrity()


def test_remove_remembers_registered_hashes_for_evict_finished() -> None:
    m = KVCacheManager(num_blocks=5, block_size=2, max_remembered_finished=2)
    computed(m, "a", [1, 2, 3, 4, 5])  # [0, 1, 2], blocks 0 and 1 cached
    hit = m.get_computed_blocks("b", [1, 2, 9])
    m.allocate_slots("b", 3, hit)  # b shares block 0
    assert m.block_table("b") == [0, 3]
    m.remove("a")
    assert m.evict_finished("a") == 1  # block 1; block 0 stays cached, b uses it
    assert m.pool.block_hash(0) is not None and m.pool.block_hash(1) is None
    assert m.evict_finished("a") is None and m.evict_finished("b") is None
    m.remove("w")  # finished while waiting: holds nothing, remembered all the same
    assert m.evict_finished("w") == 0
    for request_id in ("x", "y", "z"):
        m.remove(request_id)
    assert m.evict_finished("x") is None and m.evict_finished("z") == 0  # only the last 2 are kept
    m.check_integrity()


def test_check_integrity_catches_a_lost_reference() -> None:
    m = KVCacheManager(num_blocks=4, block_size=BS)
    m.allocate_slots("a", 8)
    m.check_integrity()
    m._block_tables["a"].append(0)
    with pytest.raises(IntegrityError, match="lists a block twice"):
        m.check_integrity()
    m._block_tables["a"][-1] = 3  # listed, but never referenced in the pool
    with pytest.raises(IntegrityError, match="block 3 has ref count 0 but 1 holders"):
        m.check_integrity()


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0, block_size=BS)
