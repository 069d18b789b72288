"""KV-cache block bookkeeping: the manager of block tables, the block pool, the prefix-cache hash chain, the
events of the prefix cache and cache sizing. Pure Python."""

from kvcache.block_pool import BlockPool
from kvcache.errors import IntegrityError, NoFreeBlocksError
from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvcache.manager import NO_PREFIX, CachedPrefix, KVCacheManager
from kvcache.prefix_hash import hash_block, hash_full_blocks
from kvcache.sizing import CacheTooSmallError, blocks_for_tokens, bytes_per_block, num_blocks_for_budget

__all__ = [
    "NO_PREFIX",
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheTooSmallError",
    "CachedPrefix",
    "IntegrityError",
    "KVCacheEvent",
    "KVCacheManager",
    "NoFreeBlocksError",
    "blocks_for_tokens",
    "bytes_per_block",
    "hash_block",
    "hash_full_blocks",
    "num_blocks_for_budget",
]
