"""BlockPool, the prefix-hash chain and cache sizing: exact block ids and eviction order."""

from __future__ import annotations

import pytest

from kvcache.block_pool import BlockPool
from kvcache.errors import IntegrityError, NoFreeBlocksError
from kvcache.prefix_hash import hash_block, hash_full_blocks
from kvcache.sizing import CacheTooSmallError, blocks_for_tokens, bytes_per_block, num_blocks_for_budget

BS = 4


def test_fresh_pool_hands_out_blocks_in_order() -> None:
    pool = BlockPool(num_blocks=6)
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
    pool = BlockPool(num_blocks=6)
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


def test_touch_shares_blocks_until_the_last_reference_is_freed() -> None:
    pool = BlockPool(num_blocks=4)
    blocks = pool.allocate(2)
    pool.touch(blocks)
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.free(blocks)
    assert pool.free_queue() == [2, 3]  # still referenced once: not free
    pool.free(blocks)
    assert pool.free_queue() == [2, 3, 0, 1]
    with pytest.raises(ValueError, match="double free"):
        pool.free([0])
    with pytest.raises(ValueError, match="outside the pool"):
        pool.free([4])
    with pytest.raises(ValueError, match="outside the pool"):
        pool.touch([-1])
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


def test_a_cached_free_block_is_taken_back_from_the_middle_of_the_queue() -> None:
    pool = BlockPool(num_blocks=8)
    hashes = hash_full_blocks(list(range(10)), BS)  # 2 full blocks + 2 tokens
    blocks = pool.allocate(3)  # [0, 1, 2]
    assert pool.cache_blocks(blocks[:2], hashes) == 2
    assert pool.num_cached_blocks == 2 and pool.block_hash(2) is None
    pool.free(reversed(blocks))
    assert pool.free_queue() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert pool.num_free_blocks == 8  # cached blocks are free too
    # the lookup only looks; touching takes the blocks back, wherever they are in the queue
    assert [pool.cached_block(h) for h in hashes] == [0, 1]
    assert pool.free_queue() == [3, 4, 5, 6, 7, 2, 1, 0]
    pool.touch([0, 1])
    assert [pool.ref_count(b) for b in (0, 1)] == [1, 1]
    assert pool.free_queue() == [3, 4, 5, 6, 7, 2]
    assert pool.block_hash(0) == hashes[0]  # taken back with its hash
    pool.touch([0])  # a second request shares the first block
    assert pool.ref_count(0) == 2
    assert pool.cached_block(hash_block(None, (7, 7, 7, 7))) is None
    pool.check_integrity()


def test_allocating_a_cached_free_block_evicts_its_hash() -> None:
    pool = BlockPool(num_blocks=3)
    (h,) = hash_full_blocks(list(range(5)), BS)
    blocks = pool.allocate(2)  # [0, 1]
    pool.cache_blocks(blocks[:1], [h])
    pool.free(reversed(blocks))
    assert pool.free_queue() == [2, 1, 0]
    assert pool.allocate(2) == [2, 1]  # block 1 was uncached (partial): nothing lost
    assert pool.block_hash(0) == h
    assert pool.allocate(1) == [0]  # the cached block is reused: its hash goes
    assert pool.block_hash(0) is None and pool.num_cached_blocks == 0
    assert pool.cached_block(h) is None
    pool.check_integrity()


def test_duplicate_hash_stays_uncached_and_uncache_drops_hashes() -> None:
    pool = BlockPool(num_blocks=6)
    hashes = hash_full_blocks(list(range(8)), BS)
    a = pool.allocate(2)  # [0, 1]
    b = pool.allocate(2)  # [2, 3] computed the same tokens concurrently
    assert pool.cache_blocks(a, hashes) == 2
    assert pool.cache_blocks(b, hashes) == 0
    assert pool.block_hash(2) is None
    assert pool.cache_blocks(a, hashes) == 0  # idempotent
    with pytest.raises(ValueError, match="another hash"):
        pool.cache_blocks(a, hash_full_blocks(list(range(1, 9)), BS))
    pool.free(reversed(a))
    pool.free(reversed(b))
    assert pool.free_queue() == [4, 5, 1, 0, 3, 2]
    pool.uncache([1])
    assert pool.block_hash(1) is None and pool.block_hash(0) == hashes[0]
    pool.uncache([0, 3])  # an uncached block is skipped
    assert pool.num_cached_blocks == 0
    assert pool.free_queue() == [4, 5, 1, 0, 3, 2]  # uncaching only forgets hashes
    pool.check_integrity()


def test_prefix_caching_off_caches_nothing() -> None:
    pool = BlockPool(num_blocks=4, enable_prefix_caching=False)
    blocks = pool.allocate(2)
    hashes = hash_full_blocks(list(range(8)), BS)
    assert pool.cache_blocks(blocks, hashes) == 0
    pool.free(reversed(blocks))
    assert pool.cached_block(hashes[0]) is None and pool.num_cached_blocks == 0
    pool.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    pool = BlockPool(num_blocks=4)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, hash_full_blocks(list(range(8)), BS))
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
        BlockPool(num_blocks=0)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=True)


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
    assert [blocks_for_tokens(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
