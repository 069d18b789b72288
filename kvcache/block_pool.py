"""The pool of KV-cache blocks: reference counts, a free queue in eviction order and the prefix cache.

Modelled on vLLM v1's ``BlockPool``. Every block ``0..num_blocks-1`` is a real block (no reserved null
block). A block is either *referenced* (ref count > 0: some request's block table holds it) or *free* (ref
count 0: it sits in the free queue). A free block may still be *cached*: it keeps its hash and its KV
contents until it is handed out again, so a later request with the same prefix can take it back
(``get_cached_prefix``) instead of recomputing it. The free queue is in eviction order: ``allocate`` pops
from its head (least recently freed first), ``free`` appends at its tail.

Pure Python: the pool hands out ids; the engine owns the tensors they index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvcache.prefix_hash import hash_full_blocks


class NoFreeBlocksError(RuntimeError):
    """``allocate`` asked for more blocks than are free. Check with ``can_allocate`` first."""


class IntegrityError(RuntimeError):
    """An internal invariant of the pool (or of the scheduler above it) does not hold: a bug, not a user
    error. Raised by ``check_integrity``."""


class BlockPool:
    """Blocks, reference counts, the free queue and the hash -> block map of the prefix cache.

    Verbs come in check/act pairs (``can_allocate`` / ``allocate``). With ``enable_prefix_caching=False``
    nothing is ever hashed or cached and ``get_cached_prefix`` always returns ``[]``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._enable_prefix_caching = enable_prefix_caching
        self._ref_counts: list[int] = [0] * num_blocks
        self._hashes: list[int | None] = [None] * num_blocks
        # NOTE: an OrderedDict gives O(1) pop from the head, append at the tail and removal from the middle
        # (a cached block taken back by a prefix hit leaves the queue wherever it is).
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache, total
        self.prefix_cache_hits = 0  # of which served from the cache, total

    # ---- state ----------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

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

    # ---- allocation -----------------------------------------------------------------------------------
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

    def fork(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each (referenced) block: another request now shares it."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"cannot fork block {block_id}: it is free")
            self._ref_counts[block_id] += 1

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block, taking a free (cached) one out of the free queue."""
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self._ref_counts[block_id] += 1

    def count_unreferenced(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` are free: touching them takes that many blocks out of the free queue."""
        return sum(1 for b in block_ids if self._ref_counts[b] == 0)

    # ---- prefix cache ---------------------------------------------------------------------------------
    def max_cacheable_blocks(self, num_tokens: int) -> int:
        """How many leading full blocks of a ``num_tokens``-token sequence may come from the cache.

        NOTE: at least the last token is always left to compute, even when every block is cached: its
        logits give the next token. So the cap is ``num_tokens - 1`` rounded down to full blocks.
        """
        return max(num_tokens - 1, 0) // self._block_size

    def find_cached_blocks(self, block_hashes: Sequence[int]) -> list[int]:
        """The blocks of the longest cached run of ``block_hashes`` (a hash chain, from the first block).
        Looks only: nothing is touched or counted."""
        if not self._enable_prefix_caching:
            return []
        out: list[int] = []
        for h in block_hashes:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            out.append(block_id)
        return out

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup (in tokens); for callers that use ``find_cached_blocks`` + ``touch``."""
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def get_cached_prefix(
        self, token_ids: Sequence[int], block_hashes: Sequence[int] | None = None
    ) -> list[int]:
        """The blocks holding the longest cached prefix of ``token_ids`` (full blocks only, capped so the
        last token is left to compute). They are touched (the caller now holds a reference to each) and
        the lookup is counted in tokens. ``block_hashes`` may pass the chain if the caller has it."""
        if not self._enable_prefix_caching:
            return []
        cap = self.max_cacheable_blocks(len(token_ids))
        if block_hashes is None:
            block_hashes = hash_full_blocks(token_ids, self._block_size, max_blocks=cap)
        blocks = self.find_cached_blocks(block_hashes[:cap])
        self.touch(blocks)
        self.record_prefix_query(len(token_ids), len(blocks) * self._block_size)
        return blocks

    def cache_full_blocks(
        self, token_ids: Sequence[int], block_ids: Sequence[int], block_hashes: Sequence[int] | None = None
    ) -> int:
        """Register the full blocks of a sequence: ``block_ids[i]`` holds tokens
        ``token_ids[i*block_size:(i+1)*block_size]``. Only blocks whose tokens are all in ``token_ids``
        (and whose KV is computed: the caller passes computed tokens only) are registered. A block already
        cached is skipped; when another block already holds the same hash the duplicate stays uncached.
        Returns how many blocks were newly registered."""
        if not self._enable_prefix_caching:
            return 0
        num_full = min(len(token_ids) // self._block_size, len(block_ids))
        if block_hashes is None:
            block_hashes = hash_full_blocks(token_ids, self._block_size, max_blocks=num_full)
        if len(block_hashes) < num_full:
            raise ValueError(f"{len(block_hashes)} block hashes given for {num_full} full blocks")
        return self.cache_blocks(block_ids[:num_full], block_hashes[:num_full])

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[int]) -> int:
        """Register ``block_ids[i]`` under ``block_hashes[i]`` (full, computed blocks of one hash chain).
        Same rules as ``cache_full_blocks``; for callers that keep a request's hash chain themselves."""
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

    def evict(self, num_blocks: int | None = None) -> list[int]:
        """Drop the hashes of up to ``num_blocks`` (all if None) cached blocks that no request references,
        in eviction order. The blocks stay free where they are in the queue. Returns their ids."""
        evicted: list[int] = []
        for block_id in self._free_queue:
            if num_blocks is not None and len(evicted) >= num_blocks:
                break
            if self._hashes[block_id] is not None:
                self._drop_hash(block_id)
                evicted.append(block_id)
        return evicted

    def evict_hashes(self, block_hashes: Iterable[int]) -> list[int]:
        """Drop these hashes from the prefix cache where their block is unreferenced (blocks in use stay
        cached: a running request shares them). Returns the ids of the blocks whose hash was dropped."""
        evicted: list[int] = []
        for h in block_hashes:
            block_id = self._hash_to_block.get(h)
            if block_id is not None and self._ref_counts[block_id] == 0:
                self._drop_hash(block_id)
                evicted.append(block_id)
        return evicted

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
