"""The pool of KV-cache blocks: reference counts, a free queue in eviction order and the prefix-cache map.

Modelled on vLLM v1's ``BlockPool``. Every block ``0..num_blocks-1`` is a real block (no reserved null
block). A block is either *referenced* (ref count > 0: some block table holds it) or *free* (ref count 0:
it sits in the free queue). A free block may still be *cached*: it keeps its hash and its KV contents until
it is handed out again, so a later request with the same prefix can take it back (``cached_block`` then
``touch``) instead of recomputing it. The free queue is in eviction order: ``allocate`` pops from its head
(least recently freed first), ``free`` appends at its tail.

Pure Python and token-blind: the pool hands out ids and maps hashes to them; ``KVCacheManager`` decides
which tokens a hash stands for, and the engine owns the tensors the ids index. Given an ``events`` list, the
pool appends a ``BlockRemoved`` whenever a hash leaves the cache and an ``AllBlocksCleared`` when the cache
is cleared (kvcache/events.py); the manager, which knows the tokens, records the ``BlockStored``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvcache.errors import IntegrityError, NoFreeBlocksError
from kvcache.events import AllBlocksCleared, BlockRemoved, KVCacheEvent


class BlockPool:
    """Blocks, reference counts, the free queue and the hash -> block map of the prefix cache.

    Verbs come in check/act pairs (``can_allocate`` / ``allocate``). With ``enable_prefix_caching=False``
    nothing is ever cached and ``cached_block`` always returns None.
    """

    def __init__(
        self, num_blocks: int, enable_prefix_caching: bool = True, events: list[KVCacheEvent] | None = None
    ) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._enable_prefix_caching = enable_prefix_caching
        self._ref_counts: list[int] = [0] * num_blocks
        self._hashes: list[int | None] = [None] * num_blocks
        # NOTE: an OrderedDict gives O(1) pop from the head, append at the tail and removal from the middle
        # (a cached block taken back by a prefix hit leaves the queue wherever it is).
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._events = events  # None: not recording

    # ---- state ----------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self._enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references, cached ones included (they are evicted when handed out)."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self._num_blocks - len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, 0..1."""
        return self.num_used_blocks / self._num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, referenced or not."""
        return len(self._hash_to_block)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> int | None:
        self._check_id(block_id)
        return self._hashes[block_id]

    def free_queue(self) -> list[int]:
        """The free blocks in eviction order (the next ``allocate`` takes from the front)."""
        return list(self._free_queue)

    # ---- references -----------------------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= len(self._free_queue)

    def allocate(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` blocks from the head of the free queue, each with ref count 1. A popped block
        that was cached loses its hash: its contents are about to be overwritten."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if num_blocks > len(self._free_queue):
            raise NoFreeBlocksError(
                f"asked for {num_blocks} blocks but only {len(self._free_queue)} of {self._num_blocks} are free"
            )
        out: list[int] = []
        for _ in range(num_blocks):
            block_id, _unused = self._free_queue.popitem(last=False)
            self._drop_hash(block_id)
            self._ref_counts[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (another block table shares it). A free block, which only a
        prefix-cache hit can name, leaves the free queue and keeps its hash."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block, in the order given; a block whose count reaches 0 goes to the
        tail of the free queue (keeping its hash, if cached).

        NOTE: pass a request's blocks in REVERSE order (as vLLM does): its tail blocks then sit nearer the
        head of the queue and are evicted first, while the shared-prefix blocks, the most reusable, stay
        cached longest.
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"block {block_id} is already free (double free)")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free_queue[block_id] = None

    # ---- prefix cache ---------------------------------------------------------------------------------
    def cached_block(self, block_hash: int) -> int | None:
        """The block registered under ``block_hash``, referenced or free, or None. Looks only."""
        return self._hash_to_block.get(block_hash)

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[int]) -> int:
        """Register ``block_ids[i]`` under ``block_hashes[i]`` (full blocks whose KV is computed). A block
        already cached under the same hash is skipped; when another block already holds the hash the
        duplicate stays uncached. Returns how many blocks were newly registered."""
        if not self._enable_prefix_caching:
            return 0
        added = 0
        for block_id, h in zip(block_ids, block_hashes, strict=True):
            self._check_id(block_id)
            current = self._hashes[block_id]
            if current is not None:
                if current != h:
                    raise ValueError(f"block {block_id} is cached with another hash: its tokens differ")
                continue
            if h in self._hash_to_block:
                # NOTE: another block already holds these tokens (two requests computed the same prefix
                # at once); this copy stays uncached and is recycled normally when freed.
                continue
            self._hashes[block_id] = h
            self._hash_to_block[h] = block_id
            added += 1
        return added

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks' hashes from the prefix cache (their contents are about to change, or are no
        longer wanted). The blocks keep their references and their place in the free queue."""
        for block_id in block_ids:
            self._check_id(block_id)
            self._drop_hash(block_id)

    def clear_cache(self) -> bool:
        """Drop every hash from the prefix cache, as a fresh pool. Only while no block is referenced: a
        running request's blocks stay as they are, and False is returned."""
        if self.num_used_blocks:
            return False
        for block_id in self._hash_to_block.values():
            self._hashes[block_id] = None
        self._hash_to_block.clear()
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    # ---- invariants -----------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` when ref counts, free queue and hash map disagree."""
        for block_id in range(self._num_blocks):
            ref = self._ref_counts[block_id]
            if ref < 0:
                raise IntegrityError(f"block {block_id} has a negative ref count {ref}")
            if (ref == 0) != (block_id in self._free_queue):
                raise IntegrityError(
                    f"block {block_id} has ref count {ref} but is {'' if block_id in self._free_queue else 'not '}"
                    "in the free queue"
                )
            h = self._hashes[block_id]
            if h is not None and self._hash_to_block.get(h) != block_id:
                raise IntegrityError(f"block {block_id} has a hash the hash map does not point back to it")
        if len(self._free_queue) > self._num_blocks or any(
            not 0 <= b < self._num_blocks for b in self._free_queue
        ):
            raise IntegrityError("the free queue holds ids outside the pool")
        for h, block_id in self._hash_to_block.items():
            if self._hashes[block_id] != h:
                raise IntegrityError(
                    f"the hash map points to block {block_id}, which does not carry that hash"
                )
        if self._hash_to_block and not self._enable_prefix_caching:
            raise IntegrityError("blocks are cached although prefix caching is off")

    # ---- helpers --------------------------------------------------------------------------------------
    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} is outside the pool (0..{self._num_blocks - 1})")

    def _drop_hash(self, block_id: int) -> None:
        h = self._hashes[block_id]
        if h is not None:
            del self._hash_to_block[h]
            self._hashes[block_id] = None
            if self._events is not None:
                self._events.append(BlockRemoved((h,)))
