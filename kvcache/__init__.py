"""KV-cache block bookkeeping: the block pool, the prefix-cache hash chain and cache sizing. Pure Python."""

from kvcache.block_pool import BlockPool, IntegrityError, NoFreeBlocksError
from kvcache.prefix_hash import hash_block, hash_full_blocks
from kvcache.sizing import CacheTooSmallError, bytes_per_block, num_blocks_for_budget

__all__ = [
    "BlockPool",
    "CacheTooSmallError",
    "IntegrityError",
    "NoFreeBlocksError",
    "bytes_per_block",
    "hash_block",
    "hash_full_blocks",
    "num_blocks_for_budget",
]
