"""The KV-cache manager: every request's block table, between the scheduler and the block pool.

Modelled on vLLM v1's ``KVCacheManager``. The scheduler decides who runs and how many tokens; it asks this
manager for the blocks those tokens need and never touches a reference count or a hash. Keyed by request
id, the manager keeps:

- the block tables: request id -> block ids, block ``i`` holding tokens ``i*block_size .. (i+1)*block_size-1``;
- each request's hash chain (``prefix_hash``) and how many of its leading blocks are registered in the pool's
  prefix cache;
- the pending copy-on-write copies of forks: child id -> (src, dst);
- the registered hashes of recently finished requests, so that ``evict_finished`` can drop them later.

Verbs come in check/act pairs, as in nano-vllm and vLLM: ``get_computed_blocks`` finds a prefix hit,
``can_allocate_slots`` / ``allocate_slots`` grow a table to hold N tokens (taking the hit), ``cache_computed``
registers newly computed full blocks, ``fork`` shares a parent's blocks (copy on write), ``truncate`` rolls a
request back, ``free`` releases a table and ``remove`` forgets a finished request. Pure Python: the engine
owns the tensors the block ids index.

With ``record_events`` the manager and its pool record every change to the set of cached blocks
(kvcache/events.py) for ``take_events``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby

from kvcache.block_pool import BlockPool
from kvcache.errors import IntegrityError, NoFreeBlocksError
from kvcache.events import BlockStored, KVCacheEvent
from kvcache.prefix_hash import hash_full_blocks
from kvcache.sizing import blocks_for_tokens

MAX_REMEMBERED_FINISHED = 4096  # finished requests whose cached blocks can still be evicted by id


@dataclass(frozen=True)
class CachedPrefix:
    """A prefix-cache hit found by ``get_computed_blocks``, not yet taken: ``allocate_slots`` takes the
    blocks and counts the lookup. Valid until the pool next changes."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0  # tokens the blocks hold: len(block_ids) * block_size
    num_query_tokens: int = 0  # tokens looked up; 0 when prefix caching is off


NO_PREFIX = CachedPrefix()


class KVCacheManager:
    """Block tables, hash chains, pending copies and finished hashes over one ``BlockPool``.

    Engine thread only; not thread-safe. A request holds a block table from its first ``allocate_slots``
    (or ``fork``) until ``free`` or ``remove``.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        max_remembered_finished: int = MAX_REMEMBERED_FINISHED,
        record_events: bool = False,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self._events: list[KVCacheEvent] | None = [] if record_events else None
        self._pool = BlockPool(num_blocks, enable_prefix_caching, self._events)
        self._block_size = block_size
        self._block_tables: dict[str, list[int]] = {}
        # A request's chain grows with its tokens and outlives its table (a preempted request comes back
        # with the same tokens); ``_num_registered`` counts its leading blocks registered in the pool.
        self._hash_chains: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        # The child holds one extra reference on ``src`` until the copy is taken for the engine, so ``src``
        # cannot be reused before it is copied.
        self._pending_copies: dict[str, tuple[int, int]] = {}
        self._finished_hashes: OrderedDict[str, list[int]] = OrderedDict()
        self._max_remembered_finished = max_remembered_finished
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache by taken hits, total
        self.prefix_cache_hits = 0  # of which served from the cache, total

    # ---- state ----------------------------------------------------------------------------------------
    @property
    def pool(self) -> BlockPool:
        """The pool, for inspection (tests, metrics); every change goes through the manager's verbs."""
        return self._pool

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (cached-but-free blocks count as free), 0..1."""
        return self._pool.usage

    @property
    def request_ids(self) -> set[str]:
        """The requests that hold a block table."""
        return set(self._block_tables)

    def has_pending_copy(self, request_id: str) -> bool:
        """Whether the request's last block still waits for its copy-on-write copy (a fork not yet run)."""
        return request_id in self._pending_copies

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order ([] when it holds none). The manager's own list: read
        it, never change it; it stays valid (and grows) until the request is freed."""
        return self._block_tables.get(request_id, [])

    # ---- allocation -----------------------------------------------------------------------------------
    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int]) -> CachedPrefix:
        """The longest run of the request's leading full blocks in the prefix cache. Looks only.

        NOTE: at least the last token is always left to compute, even when every block is cached: its
        logits give the next token. So the hit is capped at ``len(token_ids) - 1`` tokens, in full blocks.
        """
        if not self._pool.enable_prefix_caching:
            return NO_PREFIX
        cap = max(len(token_ids) - 1, 0) // self._block_size
        blocks: list[int] = []
        for h in self._chain(request_id, cap, lambda: token_ids)[:cap]:
            block_id = self._pool.cached_block(h)
            if block_id is None:
                break
            blocks.append(block_id)
        return CachedPrefix(tuple(blocks), len(blocks) * self._block_size, len(token_ids))

    def can_allocate_slots(
        self, request_id: str, num_tokens: int, cached: CachedPrefix = NO_PREFIX, num_reserved_blocks: int = 0
    ) -> bool:
        """Whether ``allocate_slots`` can give the request blocks for its first ``num_tokens`` tokens and
        still leave ``num_reserved_blocks`` blocks free."""
        return self._num_free_after(request_id, num_tokens, cached) >= num_reserved_blocks

    def allocate_slots(self, request_id: str, num_tokens: int, cached: CachedPrefix = NO_PREFIX) -> list[int]:
        """Grow the request's block table to hold its first ``num_tokens`` tokens; returns the new blocks.

        ``cached`` (a request holding no blocks yet) is taken first: its blocks are shared and the lookup
        is counted in ``prefix_cache_queries`` / ``prefix_cache_hits``. Raises ``NoFreeBlocksError`` when
        ``can_allocate_slots`` is false.
        """
        table = self._block_tables.get(request_id)
        if table is None:
            table = self._start_table(request_id, num_tokens, cached)
        elif cached.num_query_tokens:
            raise ValueError(f"request {request_id!r} holds blocks: a prefix hit is taken at admission only")
        new_blocks = self._pool.allocate(self._num_new_blocks(request_id, num_tokens, NO_PREFIX))
        table.extend(new_blocks)
        return new_blocks

    def cache_computed(
        self, request_id: str, num_computed: int, token_ids: Callable[[], Sequence[int]]
    ) -> None:
        """Register the request's full blocks whose ``num_computed`` leading tokens have their KV, so later
        requests can share them.

        NOTE: ``token_ids`` is called only when a block newly fills: building a request's token list on
        every step would cost more than the rest of this bookkeeping.
        """
        if not self._pool.enable_prefix_caching:
            return
        table = self._block_tables[request_id]
        num_full = min(num_computed // self._block_size, len(table))
        start = self._num_registered[request_id]
        if num_full <= start:
            return
        hashes = self._chain(request_id, num_full, token_ids)
        if self._events is not None:
            self._record_stored(self._events, hashes, start, num_full, token_ids())
        self._pool.cache_blocks(table[start:num_full], hashes[start:num_full])
        self._num_registered[request_id] = num_full

    # ---- sharing --------------------------------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str, num_shared_tokens: int) -> bool:
        """Give ``child_id`` the parent's KV of its first ``num_shared_tokens`` tokens: the full blocks are
        shared (never written again) and the last partial block is copied on write into a new block, the
        copy waiting in ``take_pending_copies``. Returns False, changing nothing, when that block cannot be
        had (no free block)."""
        parent = self._block_tables[parent_id]
        if child_id in self._block_tables:
            raise ValueError(f"forked request {child_id!r} already holds blocks")
        if not 1 <= num_shared_tokens <= len(parent) * self._block_size:
            raise ValueError(
                f"cannot share {num_shared_tokens} tokens of {parent_id!r}, which holds {len(parent)} blocks"
            )
        num_full, partial = divmod(num_shared_tokens, self._block_size)
        if partial and not self._pool.can_allocate(1):
            return False
        shared = parent[:num_full]
        self._pool.touch(shared)
        table = list(shared)
        if partial:
            src = parent[num_full]
            (dst,) = self._pool.allocate(1)
            self._pool.touch([src])  # held until the copy is taken for the engine
            self._pending_copies[child_id] = (src, dst)
            table.append(dst)
        self._block_tables[child_id] = table
        self._num_registered[child_id] = 0
        return True

    def take_pending_copies(self, request_ids: Iterable[str]) -> list[tuple[int, int]]:
        """The (src, dst) copies these requests are owed, in their order, for the engine to perform before
        the step's forward; after that ``src`` may be reused, so its hold is dropped here."""
        if not self._pending_copies:
            return []
        copies: list[tuple[int, int]] = []
        for request_id in request_ids:
            copy = self._pending_copies.pop(request_id, None)
            if copy is not None:
                copies.append(copy)
                self._pool.free([copy[0]])
        return copies

    # ---- shrinking ------------------------------------------------------------------------------------
    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Roll the request back to its first ``num_tokens`` tokens (speculative decoding's rejected drafts).

        The blocks past them are freed, tail first, and the blocks from the cut on lose their hashes unless
        another table shares them: their tokens are not the request's any more. Raises ``ValueError`` when
        the cut falls inside a block another table shares: that block is about to be rewritten.
        """
        table = self._block_tables[request_id]
        if num_tokens < 0:
            raise ValueError(f"cannot truncate {request_id!r} to {num_tokens} tokens")
        num_full = num_tokens // self._block_size
        keep = blocks_for_tokens(num_tokens, self._block_size)
        if keep > num_full and keep <= len(table) and self._num_holders(table[num_full]) > 1:
            raise ValueError(f"request {request_id!r}: block {table[num_full]} is shared and cannot be cut")
        self._pool.uncache(b for b in table[num_full:] if self._num_holders(b) == 1)
        copy = self._pending_copies.get(request_id)
        if copy is not None and copy[1] in table[keep:]:
            del self._pending_copies[request_id]
            self._pool.free([copy[0]])
        self._pool.free(reversed(table[keep:]))
        del table[keep:]
        del self._hash_chains.get(request_id, [])[num_full:]
        self._num_registered[request_id] = min(self._num_registered[request_id], num_full)

    def free(self, request_id: str) -> None:
        """Release the request's block table, tail first, and its pending copy. Its hash chain is kept: a
        preempted request comes back with the same tokens."""
        copy = self._pending_copies.pop(request_id, None)
        if copy is not None:
            self._pool.free([copy[0]])
        table = self._block_tables.pop(request_id, None)
        if table is not None:
            # NOTE: reversed, so the request's tail blocks are evicted before its (more shareable) prefix.
            self._pool.free(reversed(table))
        self._num_registered.pop(request_id, None)

    def remove(self, request_id: str) -> None:
        """Forget a finished request: ``free`` it and drop its hash chain, remembering its registered
        hashes (for the last ``max_remembered_finished`` requests) for ``evict_finished``."""
        registered = self._hash_chains.pop(request_id, [])[: self._num_registered.get(request_id, 0)]
        self.free(request_id)
        if self._pool.enable_prefix_caching:
            self._finished_hashes[request_id] = registered
            while len(self._finished_hashes) > self._max_remembered_finished:
                self._finished_hashes.popitem(last=False)

    def finished_request_ids(self) -> list[str]:
        """The recently removed requests whose registered blocks ``evict_finished`` can still drop."""
        return list(self._finished_hashes)

    def evict_finished(self, request_id: str) -> int | None:
        """Drop a removed request's blocks from the prefix cache, those no table holds. Returns how many
        were dropped; None when the request is not among the recently removed."""
        hashes = self._finished_hashes.pop(request_id, None)
        if hashes is None:
            return None
        # NOTE: a block in use stays cached (a running request shares it); a block since reused holds
        # another hash and is not found.
        blocks = [
            b
            for h in hashes
            if (b := self._pool.cached_block(h)) is not None and self._pool.ref_count(b) == 0
        ]
        self._pool.uncache(blocks)
        return len(blocks)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, as after a restart. Only while no request holds blocks (False, nothing
        changed, otherwise): a running request's registered blocks cannot be forgotten under it."""
        if not self._pool.clear_cache():
            return False
        self._finished_hashes.clear()
        return True

    # ---- events ---------------------------------------------------------------------------------------
    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, in order ([] when not recording)."""
        if not self._events:
            return []
        events = list(self._events)
        self._events.clear()  # NOTE: the pool appends to this same list: empty it, never replace it.
        return events

    def _record_stored(
        self, events: list[KVCacheEvent], hashes: list[int], start: int, stop: int, tokens: Sequence[int]
    ) -> None:
        """One ``BlockStored`` per run of the blocks ``start..stop-1`` that ``cache_blocks`` is about to
        register (a hash already cached, under this block or a twin, is no news)."""
        bs = self._block_size
        new = [i for i in range(start, stop) if self._pool.cached_block(hashes[i]) is None]
        for _, run in groupby(enumerate(new), key=lambda pair: pair[1] - pair[0]):
            blocks = [i for _, i in run]
            first, last = blocks[0], blocks[-1] + 1
            parent = hashes[first - 1] if first > 0 else None
            events.append(
                BlockStored(tuple(hashes[first:last]), parent, tuple(tokens[first * bs : last * bs]), bs)
            )

    # ---- invariants -----------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` unless every block's ref count equals its holders (block tables plus
        pending copies), no table lists a block twice and the pool agrees with itself."""
        self._pool.check_integrity()
        refs: Counter[int] = Counter()
        for request_id, table in self._block_tables.items():
            if len(set(table)) != len(table):
                raise IntegrityError(f"request {request_id!r} lists a block twice: {table}")
            refs.update(table)
        for request_id, (src, dst) in self._pending_copies.items():
            if dst not in self._block_tables.get(request_id, []):
                raise IntegrityError(f"pending copy {src}->{dst} of {request_id!r} outlived its block table")
            refs[src] += 1
        for block_id in range(self.num_blocks):
            if self._pool.ref_count(block_id) != refs[block_id]:
                raise IntegrityError(
                    f"block {block_id} has ref count {self._pool.ref_count(block_id)} but {refs[block_id]} holders"
                )
        if set(self._num_registered) != set(self._block_tables):
            raise IntegrityError("registered-block counts and block tables name different requests")

    # ---- helpers --------------------------------------------------------------------------------------
    def _start_table(self, request_id: str, num_tokens: int, cached: CachedPrefix) -> list[int]:
        """A new block table that begins with the prefix hit ``cached``, taken: shared and counted."""
        if self._num_free_after(request_id, num_tokens, cached) < 0:
            raise NoFreeBlocksError(f"request {request_id!r}: not enough free blocks for {num_tokens} tokens")
        self._pool.touch(cached.block_ids)
        self.prefix_cache_queries += cached.num_query_tokens
        self.prefix_cache_hits += cached.num_tokens
        self._num_registered[request_id] = len(cached.block_ids)  # a hit is registered already
        table = self._block_tables[request_id] = list(cached.block_ids)
        return table

    def _chain(self, request_id: str, num_blocks: int, token_ids: Callable[[], Sequence[int]]) -> list[int]:
        """The hash chain of the request's first ``num_blocks`` full blocks (computed once, then extended)."""
        known = self._hash_chains.get(request_id, [])
        if len(known) < num_blocks:
            known = hash_full_blocks(token_ids(), self._block_size, known=known, max_blocks=num_blocks)
            self._hash_chains[request_id] = known
        return known

    def _num_new_blocks(self, request_id: str, num_tokens: int, cached: CachedPrefix) -> int:
        held = len(self._block_tables.get(request_id, ())) + len(cached.block_ids)
        return max(blocks_for_tokens(num_tokens, self._block_size) - held, 0)

    def _num_free_after(self, request_id: str, num_tokens: int, cached: CachedPrefix) -> int:
        """Free blocks left once the request holds ``num_tokens`` tokens (negative: that many short)."""
        # NOTE: taking back a cached-but-free block removes it from the free queue too.
        num_taken_back = (
            sum(1 for b in cached.block_ids if self._pool.ref_count(b) == 0) if cached.block_ids else 0
        )
        return (
            self._pool.num_free_blocks - num_taken_back - self._num_new_blocks(request_id, num_tokens, cached)
        )

    def _num_holders(self, block_id: int) -> int:
        """Block tables holding the block (its ref count less the holds of pending copies)."""
        holds = sum(1 for src, _ in self._pending_copies.values() if src == block_id)
        return self._pool.ref_count(block_id) - holds
