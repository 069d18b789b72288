"""KVCache: layout, sizing (explicit, byte budget, memory fraction), block copies across every layer."""

from __future__ import annotations

import os

import pytest
import torch

from engine.executor.kv_cache import KVCache


def filled_cache(num_layers: int = 3, num_blocks: int = 6) -> KVCache:
    cache = KVCache(num_layers, num_blocks, block_size=4, num_kv_heads=2, head_dim=8)
    cache.kv.copy_(torch.randn(cache.kv.shape))
    return cache


def test_layout_and_views_share_storage() -> None:
    cache = KVCache(3, 5, 4, 2, 8, torch.float32)  # 5 blocks of 4 tokens, 2 KV heads of 8 dims
    assert len(cache.k_caches) == len(cache.v_caches) == 3
    for k, v in (cache.layer(i) for i in range(3)):
        assert k.shape == (5, 2, 8, 4)  # keys transposed: [blocks, kv_heads, head_dim, block_size]
        assert v.shape == (5, 2, 4, 8)  # values: [blocks, kv_heads, block_size, head_dim]
        assert k.is_contiguous() and v.is_contiguous()
    k1, v1 = cache.layer(1)
    k1[2, 1, :, 3].fill_(7.0)  # token 3 of block 2, KV head 1
    v1[2, 1, 3].fill_(9.0)
    # Within a block, head h's keys are a [head_dim, block_size] tile: dim d of token t at h*32 + d*4 + t.
    assert [cache.kv[1, 0, 2, 32 + d * 4 + 3].item() for d in range(8)] == [7.0] * 8
    assert cache.kv[1, 1, 2, 32 + 3 * 8 : 32 + 4 * 8].tolist() == [9.0] * 8
    assert cache.kv[1].abs().sum() == 7.0 * 8 + 9.0 * 8
    assert cache.kv[0].abs().sum() == 0 and cache.kv[2].abs().sum() == 0


def test_nbytes_and_bytes_per_block() -> None:
    cache = KVCache(2, 10, 16, 3, 64, torch.bfloat16)
    assert cache.nbytes == 2 * 2 * 10 * 16 * 3 * 64 * 2
    assert KVCache.bytes_per_block(2, 16, 3, 64, torch.bfloat16) * 10 == cache.nbytes
    assert cache.num_slots == 160


def test_copy_blocks_copies_every_layer_k_and_v() -> None:
    cache = filled_cache()
    before = cache.kv.clone()
    cache.copy_blocks([(1, 4), (0, 5)])
    assert torch.equal(cache.kv[:, :, 4], before[:, :, 1])
    assert torch.equal(cache.kv[:, :, 5], before[:, :, 0])
    untouched = [0, 1, 2, 3]
    assert torch.equal(cache.kv[:, :, untouched], before[:, :, untouched])


def test_copy_blocks_reads_sources_before_writing() -> None:
    """A block that is the destination of one pair and the source of another is copied out first."""
    cache = filled_cache()
    before = cache.kv.clone()
    cache.copy_blocks([(1, 2), (2, 3)])
    assert torch.equal(cache.kv[:, :, 2], before[:, :, 1])
    assert torch.equal(cache.kv[:, :, 3], before[:, :, 2])


def test_copy_blocks_validates() -> None:
    cache = filled_cache()
    cache.copy_blocks([])  # no-op
    with pytest.raises(ValueError, match="block id 6"):
        cache.copy_blocks([(0, 6)])
    with pytest.raises(ValueError, match="duplicate destination"):
        cache.copy_blocks([(0, 3), (1, 3)])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_blocks=-1), "num_blocks"),
        (dict(block_size=0), "block_size"),
        (dict(head_dim=2.5), "head_dim"),
        (dict(dtype=torch.int32), "floating point"),
    ],
)
def test_constructor_validates(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = dict(num_layers=1, num_blocks=1, block_size=1, num_kv_heads=1, head_dim=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KVCache(**args)  # type: ignore[arg-type]


def test_allocate_by_budget_and_explicit_count() -> None:
    per_block = KVCache.bytes_per_block(2, 8, 2, 16, torch.float32)
    cache = KVCache.allocate(2, 8, 2, 16, torch.float32, budget_bytes=per_block * 7 + per_block // 2)
    assert cache.num_blocks == 7 and cache.nbytes == per_block * 7
    assert KVCache.allocate(2, 8, 2, 16, num_blocks=3).num_blocks == 3


def test_allocate_by_fraction_of_free_host_memory() -> None:
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cache = KVCache.allocate(1, 16, 1, 8, torch.float32, memory_fraction=1e-6)
    per_block = KVCache.bytes_per_block(1, 16, 1, 8, torch.float32)
    # Free memory moves while other processes run: allow a factor of 2 either way.
    assert 0.5e-6 * available - per_block <= cache.nbytes <= 2e-6 * available


def test_allocate_validates() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        KVCache.allocate(1, 16, 1, 8)
    with pytest.raises(ValueError, match="exactly one"):
        KVCache.allocate(1, 16, 1, 8, num_blocks=2, budget_bytes=10**6)
    with pytest.raises(ValueError, match="holds no block"):
        KVCache.allocate(1, 16, 1, 8, budget_bytes=100)
    with pytest.raises(ValueError, match="memory_fraction"):
        KVCache.allocate(1, 16, 1, 8, memory_fraction=1.5)
