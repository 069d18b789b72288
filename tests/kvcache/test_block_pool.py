"""BlockPool, the prefix-hash chain and cache sizing: exact block ids and eviction order."""

from __future__ import annotations

import pytest

from kvcache.block_pool import BlockPool, IntegrityError, NoFreeBlocksError
from kvcache.prefix_hash import hash_block, hash_full_blocks
from kvcache.sizing import CacheTooSmallError, bytes_per_block, num_blocks_for_budget

BS = 4


def test_fresh_pool_hands_out_blocks_in_order() -> None:
    pool = BlockPool(num_blocks=6, block_size=BS)
    assert pool.num_free_blocks == 6 and pool.num_used_blocks == 0 and pool.usage == 0.0
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 5
    assert pool.usage == pytest.approx(5 / 6)
    assert [pool.ref_count(b) for b in range(6)] == [1, 1, 1, 1, 1, 0]
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 blocks but only 1"):
        pool.allocate(2)
    pool.check_integrity()


def test_free_appends_to_the_tail_in_the_order_given() -> None:
    pool = BlockPool(num_blocks=6, block_size=BS)
    a = pool.allocate(3)  # [0, 1, 2]
    b = pool.allocate(2)  # [3, 4]
    assert pool.free_queue() == [5]
    pool.free(reversed(a))  # a request frees its blocks tail first
    assert pool.free_queue() == [5, 2, 1, 0]
    pool.free(reversed(b))
    assert pool.free_queue() == [5, 2, 1, 0, 4, 3]
    # least recently freed first
    assert pool.allocate(4) == [5, 2, 1, 0]
    pool.check_integrity()


def test_fork_shares_blocks_until_the_last_reference_is_freed() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    blocks = pool.allocate(2)
    pool.fork(blocks)
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.free(blocks)
    assert pool.free_queue() == [2, 3]  # still referenced once: not free
    pool.free(blocks)
    assert pool.free_queue() == [2, 3, 0, 1]
    with pytest.raises(ValueError, match="double free"):
        pool.free([0])
    with pytest.raises(ValueError, match="it is free"):
        pool.fork([0])
    with pytest.raises(ValueError, match="outside the pool"):
        pool.free([4])
    pool.check_integrity()


def test_hash_chain_is_deterministic_and_depends_on_the_parent() -> None:
    h0 = hash_block(None, (1, 2, 3, 4))
    assert h0 == hash_block(None, (1, 2, 3, 4))
    assert h0 != hash_block(None, (1, 2, 3, 5))
    assert hash_block(h0, (5, 6, 7, 8)) != hash_block(None, (5, 6, 7, 8))
    # the small-int collision of Python's hash() (-1 and -2) does not carry over
    assert hash_block(None, (-1,)) != hash_block(None, (-2,))
    chain = hash_full_blocks(list(range(10)), BS)
    assert chain == [hash_block(None, (0, 1, 2, 3)), hash_block(chain[0], (4, 5, 6, 7))]
    assert len(chain) == 2  # the partial block (8, 9) is not hashed
    # extending a known prefix gives the same chain
    assert hash_full_blocks(list(range(12)), BS, known=chain[:1]) == hash_full_blocks(list(range(12)), BS)
    assert hash_full_blocks(list(range(12)), BS, max_blocks=1) == chain[:1]


def test_prefix_cache_hit_touches_blocks_and_counts_tokens() -> None:
    pool = BlockPool(num_blocks=8, block_size=BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    blocks = pool.allocate(3)  # [0, 1, 2]
    assert pool.cache_full_blocks(prompt, blocks) == 2
    assert pool.num_cached_blocks == 2
    assert pool.block_hash(2) is None
    pool.free(reversed(blocks))
    assert pool.free_queue() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert pool.num_free_blocks == 8  # cached blocks are free too

    # same prompt: both full blocks come back, taken out of the middle of the free queue
    hit = pool.get_cached_prefix(prompt)
    assert hit == [0, 1]
    assert [pool.ref_count(b) for b in (0, 1)] == [1, 1]
    assert pool.free_queue() == [3, 4, 5, 6, 7, 2]
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (10, 8)

    # a prompt sharing only the first block; the cached block is now shared (ref count 2)
    other = [0, 1, 2, 3, 9, 9, 9, 9, 9]
    assert pool.get_cached_prefix(other) == [0]
    assert pool.ref_count(0) == 2
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (19, 12)

    # a different first block misses entirely, even if the second block's tokens match
    assert pool.get_cached_prefix([7, 7, 7, 7, 4, 5, 6, 7, 8]) == []
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (28, 12)
    pool.check_integrity()


def test_last_token_is_never_served_from_the_cache() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    prompt = list(range(8))  # exactly 2 full blocks
    blocks = pool.allocate(2)
    pool.cache_full_blocks(prompt, blocks)
    pool.free(reversed(blocks))
    # all 8 tokens cached, yet the 8th must be computed for its logits: only 1 block (4 tokens) comes back
    assert pool.max_cacheable_blocks(8) == 1
    assert pool.get_cached_prefix(prompt) == [0]
    assert pool.prefix_cache_hits == 4
    assert pool.get_cached_prefix(list(range(9))) == [0, 1]  # a 9th token: both blocks usable
    pool.check_integrity()


def test_allocating_a_cached_free_block_evicts_its_hash() -> None:
    pool = BlockPool(num_blocks=3, block_size=BS)
    prompt = list(range(5))
    blocks = pool.allocate(2)  # [0, 1]
    pool.cache_full_blocks(prompt, blocks)
    pool.free(reversed(blocks))
    assert pool.free_queue() == [2, 1, 0]
    assert pool.allocate(2) == [2, 1]  # block 1 was uncached (partial): nothing lost
    assert pool.block_hash(0) is not None
    assert pool.allocate(1) == [0]  # the cached block is reused: its hash goes
    assert pool.block_hash(0) is None and pool.num_cached_blocks == 0
    pool.free([0, 1, 2])
    assert pool.get_cached_prefix(prompt) == []
    pool.check_integrity()


def test_duplicate_hash_stays_uncached_and_evict_drops_hashes() -> None:
    pool = BlockPool(num_blocks=6, block_size=BS)
    prompt = list(range(8))
    a = pool.allocate(2)  # [0, 1]
    b = pool.allocate(2)  # [2, 3] computed the same tokens concurrently
    assert pool.cache_full_blocks(prompt, a) == 2
    assert pool.cache_full_blocks(prompt, b) == 0
    assert pool.block_hash(2) is None
    assert pool.cache_full_blocks(prompt, a) == 0  # idempotent
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_full_blocks(list(range(1, 9)), a)
    pool.free(reversed(a))
    pool.free(reversed(b))
    assert pool.free_queue() == [4, 5, 1, 0, 3, 2]
    assert pool.evict(1) == [1]  # eviction order: block 1 was freed first
    assert pool.block_hash(1) is None and pool.block_hash(0) is not None
    assert pool.evict() == [0]
    assert pool.num_cached_blocks == 0
    assert pool.free_queue() == [4, 5, 1, 0, 3, 2]  # evicting only forgets hashes
    pool.check_integrity()


def test_prefix_caching_off_hashes_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    blocks = pool.allocate(2)
    assert pool.cache_full_blocks(list(range(8)), blocks) == 0
    pool.free(reversed(blocks))
    assert pool.get_cached_prefix(list(range(9))) == []
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits, pool.num_cached_blocks) == (0, 0, 0)
    pool.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(num_blocks=4, block_size=BS)
    blocks = pool.allocate(2)
    pool.cache_full_blocks(list(range(8)), blocks)
    pool.check_integrity()
    pool._ref_counts[3] = 1  # referenced, but still in the free queue
    with pytest.raises(IntegrityError, match="block 3 has ref count 1"):
        pool.check_integrity()
    pool._ref_counts[3] = 0
    pool._hashes[0] = 12345  # the hash map no longer points back
    with pytest.raises(IntegrityError, match="block 0"):
        pool.check_integrity()


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=0, block_size=BS)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(num_blocks=4, block_size=0)


def test_sizing() -> None:
    # SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64, fp16
    per_block = bytes_per_block(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype_bytes=2)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 2 == 368_640
    assert num_blocks_for_budget(per_block * 10 + per_block - 1, 30, 3, 64, 16, 2) == 10
    assert num_blocks_for_budget(float(per_block * 3), 30, 3, 64, 16, 2) == 3
    with pytest.raises(CacheTooSmallError, match="holds no block"):
        num_blocks_for_budget(per_block - 1, 30, 3, 64, 16, 2)
    with pytest.raises(ValueError, match="head_dim"):
        bytes_per_block(30, 3, 0, 16, 2)
    with pytest.raises(ValueError, match="budget_bytes"):
        num_blocks_for_budget(-1, 30, 3, 64, 16, 2)


def test_evict_hashes_drops_only_unreferenced_cached_blocks() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    blocks = pool.allocate(3)
    pool.cache_full_blocks(tokens, blocks)  # two full blocks: [1, 2] and [3, 4]
    hashes = [pool.block_hash(b) for b in blocks[:2]]
    assert None not in hashes
    pool.free([blocks[1]])  # block 1 unreferenced (still cached), block 0 still in use
    dropped = pool.evict_hashes([h for h in hashes if h is not None])
    assert dropped == [blocks[1]]
    assert pool.block_hash(blocks[0]) is not None and pool.block_hash(blocks[1]) is None
    pool.check_integrity()
