"""The scheduler's shared machinery; the policies (fifo.py, prefill_first.py) only order the work.

The scheduling model (as in vLLM v1): there is no prefill phase and no decode phase. Every request has
``num_tokens`` known tokens (prompt + generated so far) of which ``num_computed_tokens`` have their K/V in
the cache; each step, ``schedule()`` lets requests catch up under one token budget. A request behind by
many tokens computes a chunk of them (a prompt, a prompt's next chunk, or a preempted request's recompute);
a request behind by exactly one token (the one it just sampled) is decoding. When a chunk reaches the last
known token (``ScheduledRequest.needs_sample``) the engine samples the next token from its logits and
``update()`` appends it, which puts the request one token behind again.

Statuses follow from that: WAITING (queued, no blocks), PREFILLING (admitted, more than its last token still
to compute, or its prompt not yet computed), DECODING (admitted, every prompt token computed and at most
the last token uncomputed: one new token per step), FINISHED.

Budgets of one step: ``max_batch_tokens`` tokens, ``max_num_seqs`` requests, and the KV blocks of the pool.
A request gets, block by block, the blocks for every token it computes this step. When a running request
cannot get a block, the most recently admitted running request is preempted by recompute (its blocks are
freed, it goes back to the front of the waiting queue with ``num_computed_tokens = 0`` and its output kept,
to be recomputed like a prompt); if that is the request itself, it yields. Waiting requests are admitted
in arrival order (no skipping ahead) while blocks, the safety margin, the token budget and ``max_num_seqs``
allow, and not in a step that preempted (admitting then would only thrash).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping, Sequence

from kvcache.block_pool import BlockPool, IntegrityError
from kvcache.prefix_hash import hash_full_blocks
from scheduler.batch import ScheduledBatch, ScheduledRequest
from scheduler.config import SchedulerConfig
from scheduler.errors import RequestTooLargeError
from scheduler.request import FinishReason, Request, RequestStatus

_ADMITTED = (RequestStatus.PREFILLING, RequestStatus.DECODING)
MAX_REMEMBERED_FINISHED = 4096  # finished requests whose cached blocks can still be evicted by id


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler(ABC):
    """Decides, each step, which requests compute how many tokens, and owns their block tables.

    Call order per step (the engine thread only; not thread-safe):
    ``batch = schedule()``; the engine runs it; ``update(batch, new_tokens, finished)``. ``add_request``,
    ``finish_request`` and ``fork`` may be called between steps.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.pool = BlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # in admission order: the last was admitted most recently
        self._requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        # Prefix caching: each request's hash chain (grows with its tokens; kept across preemption since the
        # tokens do not change) and how many of its leading blocks are already registered in the pool.
        self._block_hashes: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        # Copy-on-write of forks: child id -> (src, dst). The child holds one extra reference on ``src``
        # until the copy is handed to the engine, so ``src`` cannot be reused before it is copied.
        self._pending_copies: dict[str, tuple[int, int]] = {}
        # The registered hash chains of recently finished requests, for ``evict_request_from_cache``.
        self._finished_hashes: OrderedDict[str, list[int]] = OrderedDict()
        self.num_preemptions = 0

    # ---- the policy -----------------------------------------------------------------------------------
    @abstractmethod
    def order_running(self, running: Sequence[Request]) -> list[Request]:
        """The running requests (given in admission order) in the order they get this step's budget."""

    # ---- state ----------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens looked up in the prefix cache at admissions, total."""
        return self.pool.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, tokens served from the cache, total."""
        return self.pool.prefix_cache_hits

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def kv_cache_usage(self) -> float:
        """Fraction of blocks referenced by running requests (cached-but-free blocks count as free)."""
        return self.pool.usage

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    @property
    def waiting_requests(self) -> tuple[Request, ...]:
        return tuple(self._waiting)

    @property
    def running_requests(self) -> tuple[Request, ...]:
        return tuple(self._running)

    # ---- adding ---------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a new request (at the back of the waiting queue).

        Raises ``RequestTooLargeError`` when it can never fit (prompt + ``max_new_tokens`` needs more
        blocks than the cache has, or exceeds ``max_model_len``) and ``ValueError`` for a malformed one.
        """
        self._validate_new(req)
        if req.status is not RequestStatus.WAITING or req.block_ids or req.num_computed_tokens:
            raise ValueError(f"request {req.request_id!r} must be new: WAITING, no blocks, nothing computed")
        self._requests[req.request_id] = req
        self._waiting.append(req)

    def _validate_new(self, req: Request) -> None:
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in the scheduler")
        if not req.prompt_ids:
            raise ValueError(f"request {req.request_id!r} has an empty prompt")
        if req.max_new_tokens < 1:
            raise ValueError(
                f"request {req.request_id!r}: max_new_tokens must be >= 1, got {req.max_new_tokens}"
            )
        total = len(req.prompt_ids) + req.max_new_tokens
        needed = _cdiv(total, self.block_size)
        if needed > self.num_blocks:
            raise RequestTooLargeError(
                req.request_id,
                total,
                needed,
                self.num_blocks,
                f"{len(req.prompt_ids)} prompt tokens + {req.max_new_tokens} new tokens need {needed} KV blocks of "
                f"{self.block_size} tokens, but the cache holds only {self.num_blocks} blocks",
            )
        limit = self.config.max_model_len
        if limit is not None and total > limit:
            raise RequestTooLargeError(
                req.request_id,
                total,
                needed,
                self.num_blocks,
                f"{len(req.prompt_ids)} prompt tokens + {req.max_new_tokens} new tokens exceed max_model_len={limit}",
            )

    # ---- one step -------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Build this step's batch: running requests in the policy's order, then waiting ones by arrival."""
        batch = ScheduledBatch()
        chunks: dict[str, ScheduledRequest] = {}  # insertion order is the batch order
        budget = self.config.max_batch_tokens
        preempted = False

        for req in self.order_running(self._running):
            if req.status is RequestStatus.WAITING:
                continue  # preempted earlier in this loop to make room for another
            if len(chunks) >= self.config.max_num_seqs or budget == 0:
                break
            num_new = min(req.num_uncomputed_tokens, budget)
            if num_new <= 0:
                continue
            while not self.pool.can_allocate(self._num_new_blocks(req, num_new)):
                victim = self._running[-1]
                dropped = chunks.pop(victim.request_id, None)
                if dropped is not None:
                    budget += dropped.num_tokens
                self._preempt(victim, batch)
                preempted = True
                if victim is req:
                    break
            if req.status is RequestStatus.WAITING:
                continue
            req.block_ids.extend(self.pool.allocate(self._num_new_blocks(req, num_new)))
            chunks[req.request_id] = self._chunk(req, num_new)
            budget -= num_new

        if not preempted:
            budget = self._admit_waiting(chunks, budget)

        batch.requests = list(chunks.values())
        for request_id in chunks:
            copy = self._pending_copies.pop(request_id, None)
            if copy is not None:
                # The engine copies before this step's forward; after that ``src`` may be reused.
                batch.blocks_to_copy.append(copy)
                self.pool.free([copy[0]])
        return batch

    def _admit_waiting(self, chunks: dict[str, ScheduledRequest], budget: int) -> int:
        """Admit waiting requests in arrival order while everything allows; returns the budget left."""
        reserved = self.config.num_reserved_blocks
        while (
            self._waiting
            and budget > 0
            and len(chunks) < self.config.max_num_seqs
            and len(self._running) < self.config.max_num_seqs
        ):
            req = self._waiting[0]
            cached: list[int] = []
            if self.pool.enable_prefix_caching:
                cap = self.pool.max_cacheable_blocks(req.num_tokens)
                cached = self.pool.find_cached_blocks(self._hashes_for(req, cap)[:cap])
            num_cached_tokens = len(cached) * self.block_size
            num_new = min(req.num_tokens - num_cached_tokens, budget)
            num_new_blocks = _cdiv(num_cached_tokens + num_new, self.block_size) - len(cached)
            # Taking back cached-but-free blocks removes them from the free queue too.
            available = self.pool.num_free_blocks - self.pool.count_unreferenced(cached)
            if num_new_blocks > available:
                break
            if self._running and available - num_new_blocks < reserved:
                break  # NOTE: the safety margin keeps room for the running requests to grow

            self._waiting.popleft()
            if self.pool.enable_prefix_caching:
                self.pool.touch(cached)
                self.pool.record_prefix_query(req.num_tokens, num_cached_tokens)
            req.block_ids = cached + self.pool.allocate(num_new_blocks)
            req.num_computed_tokens = num_cached_tokens
            req.num_cached_tokens = num_cached_tokens
            self._num_registered[req.request_id] = len(cached)
            self._running.append(req)
            chunks[req.request_id] = self._chunk(req, num_new)
            budget -= num_new
        return budget

    def _chunk(self, req: Request, num_new: int) -> ScheduledRequest:
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self._refresh_status(req)
        return ScheduledRequest(request=req, start=req.num_computed_tokens, num_tokens=num_new)

    def _num_new_blocks(self, req: Request, num_new: int) -> int:
        """Blocks ``req`` lacks to hold its tokens up to ``num_computed_tokens + num_new``."""
        return max(_cdiv(req.num_computed_tokens + num_new, self.block_size) - len(req.block_ids), 0)

    def update(
        self, batch: ScheduledBatch, new_tokens: Mapping[str, int], finished: Mapping[str, FinishReason]
    ) -> list[Request]:
        """Apply a step's results: advance each scheduled request by its chunk, append the token sampled
        for each chunk that ``needs_sample``, then finish the requests in ``finished`` (free their blocks;
        their full blocks stay in the prefix cache). Returns the requests finished by this call.

        Stopping is the engine's: a request ends only through ``finished`` or ``finish_request`` (so the
        engine may keep a finished parent alive until it has forked its n > 1 siblings). The cache is sized
        for ``len(prompt) + max_new_tokens``, so the engine must stop each request by then. A request that
        needed a sample but got none (and did not finish) recomputes its last token next step.
        """
        for chunk in batch.requests:
            req = chunk.request
            if req.status not in _ADMITTED or self._requests.get(req.request_id) is not req:
                continue  # finished (cancelled) between schedule() and update()
            if chunk.start != req.num_computed_tokens:
                raise IntegrityError(
                    f"request {req.request_id!r}: batch chunk starts at {chunk.start} but "
                    f"{req.num_computed_tokens} tokens are computed"
                )
            sample_due = chunk.needs_sample  # NOTE: read before appending, which moves num_tokens
            req.num_computed_tokens = chunk.end
            if sample_due:
                token = new_tokens.get(req.request_id)
                if token is not None:
                    req.output_ids.append(token)
                elif req.request_id not in finished:
                    # NOTE: with nothing sampled, the last token must run again to give logits.
                    req.num_computed_tokens -= 1
            self._cache_computed_blocks(req)
            self._refresh_status(req)

        done: list[Request] = []
        for request_id, reason in finished.items():
            ended = self._finish(request_id, reason)
            if ended is not None:
                done.append(ended)
        return done

    # ---- removing -------------------------------------------------------------------------------------
    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """Remove a waiting or running request now (cancel, error) and free its blocks. None if unknown."""
        return self._finish(request_id, reason)

    def _finish(self, request_id: str, reason: FinishReason) -> Request | None:
        req = self._requests.get(request_id)
        return None if req is None else self._finish_known(req, reason)

    def _finish_known(self, req: Request, reason: FinishReason) -> Request:
        hashes = self._block_hashes.pop(req.request_id, [])
        registered = self._num_registered.get(req.request_id, 0)
        if req.status is RequestStatus.WAITING:
            self._waiting.remove(req)
        else:
            self._running.remove(req)
            self._release_blocks(req)
        del self._requests[req.request_id]
        self._num_registered.pop(req.request_id, None)
        if self.pool.enable_prefix_caching:
            self._finished_hashes[req.request_id] = hashes[:registered]
            while len(self._finished_hashes) > MAX_REMEMBERED_FINISHED:
                self._finished_hashes.popitem(last=False)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        return req

    def evict_request_from_cache(self, request_id: str) -> int | None:
        """Drop a finished request's blocks from the prefix cache (those no running request shares).
        Returns how many were dropped; None when the request is not among the recently finished."""
        hashes = self._finished_hashes.pop(request_id, None)
        if hashes is None:
            return None
        # NOTE: only the blocks whose hash still maps to a free block go; a block since reused holds
        # another hash and is left alone.
        return len(self.pool.evict_hashes(hashes))

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        """Preempt by recompute: free the blocks, back to the front of the waiting queue, output kept."""
        self._running.remove(req)
        self._release_blocks(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(req)
        batch.preempted_ids.append(req.request_id)

    def _release_blocks(self, req: Request) -> None:
        copy = self._pending_copies.pop(req.request_id, None)
        if copy is not None:
            self.pool.free([copy[0]])
        # NOTE: reversed, so the request's tail blocks are evicted before its (more shareable) prefix.
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []
        self._num_registered[req.request_id] = 0

    # ---- n > 1 ----------------------------------------------------------------------------------------
    def fork(self, parent_id: str, child: Request) -> Request:
        """Add ``child`` (a new request whose tokens start with the parent's computed tokens) sharing the
        parent's KV: the parent's full blocks are shared (ref counted) and its last partial block is copied
        into a new block, through ``blocks_to_copy`` of the next batch that schedules the child. When no
        block is free (or the parent has computed nothing yet) the child waits and recomputes instead; the
        prefix cache then shares the full blocks. Raises ``KeyError`` for an unknown parent."""
        parent = self._requests.get(parent_id)
        if parent is None:
            raise KeyError(f"cannot fork unknown request {parent_id!r}")
        self._validate_new(child)
        if child.block_ids:
            raise ValueError(f"forked request {child.request_id!r} must hold no blocks")
        # The child must keep one token to compute (its logits give its next token).
        num_shared = min(parent.num_computed_tokens, child.num_tokens - 1)
        if child.all_token_ids[:num_shared] != parent.all_token_ids[:num_shared]:
            raise ValueError(
                f"forked request {child.request_id!r} does not start with the {num_shared} computed tokens of "
                f"{parent_id!r}"
            )
        self._requests[child.request_id] = child
        child.num_computed_tokens = 0
        num_full, partial = divmod(num_shared, self.block_size)
        if parent.status not in _ADMITTED or num_shared == 0 or (partial and not self.pool.can_allocate(1)):
            child.status = RequestStatus.WAITING
            if parent.status is RequestStatus.WAITING:
                # Right behind its parent, so the parent's blocks are cached by the time the child comes.
                self._waiting.insert(self._waiting.index(parent) + 1, child)
            else:
                self._waiting.appendleft(child)  # a sibling of a running request: next in line
            return child
        shared = parent.block_ids[:num_full]
        self.pool.fork(shared)
        child.block_ids = list(shared)
        if partial:
            src = parent.block_ids[num_full]
            (dst,) = self.pool.allocate(1)
            self.pool.fork([src])  # held until the copy is handed to the engine
            self._pending_copies[child.request_id] = (src, dst)
            child.block_ids.append(dst)
        child.num_computed_tokens = num_shared
        self._num_registered[child.request_id] = 0
        self._running.append(child)
        self._refresh_status(child)
        return child

    # ---- prefix caching -------------------------------------------------------------------------------
    def _hashes_for(self, req: Request, num_blocks: int) -> list[int]:
        """The hash chain of ``req``'s first ``num_blocks`` full blocks (computed once, then extended)."""
        known = self._block_hashes.get(req.request_id, [])
        if len(known) < num_blocks:
            known = hash_full_blocks(req.all_token_ids, self.block_size, known=known, max_blocks=num_blocks)
            self._block_hashes[req.request_id] = known
        return known

    def _cache_computed_blocks(self, req: Request) -> None:
        """Register the request's full, computed blocks so later requests can share them."""
        if not self.pool.enable_prefix_caching:
            return
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        start = self._num_registered.get(req.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes_for(req, num_full)
        self.pool.cache_blocks(req.block_ids[start:num_full], hashes[start:num_full])
        self._num_registered[req.request_id] = num_full

    def _refresh_status(self, req: Request) -> None:
        decoding = req.num_computed_tokens >= len(req.prompt_ids) and req.num_uncomputed_tokens <= 1
        req.status = RequestStatus.DECODING if decoding else RequestStatus.PREFILLING

    # ---- invariants -----------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` when the pool, the block tables and the queues disagree."""
        self.pool.check_integrity()
        refs: Counter[int] = Counter()
        for req in self._running:
            if req.status not in _ADMITTED:
                raise IntegrityError(f"running request {req.request_id!r} has status {req.status}")
            if len(set(req.block_ids)) != len(req.block_ids):
                raise IntegrityError(f"request {req.request_id!r} lists a block twice: {req.block_ids}")
            if len(req.block_ids) < _cdiv(req.num_computed_tokens, self.block_size):
                raise IntegrityError(
                    f"request {req.request_id!r} holds {len(req.block_ids)} blocks for "
                    f"{req.num_computed_tokens} computed tokens"
                )
            if not 0 <= req.num_computed_tokens <= req.num_tokens:
                raise IntegrityError(f"request {req.request_id!r} computed {req.num_computed_tokens} tokens")
            refs.update(req.block_ids)
        for request_id, (src, dst) in self._pending_copies.items():
            child = self._requests.get(request_id)
            if child is None or child.status not in _ADMITTED or dst not in child.block_ids:
                raise IntegrityError(f"pending copy {src}->{dst} of {request_id!r} outlived its request")
            refs[src] += 1
        for block_id in range(self.num_blocks):
            if self.pool.ref_count(block_id) != refs[block_id]:
                raise IntegrityError(
                    f"block {block_id} has ref count {self.pool.ref_count(block_id)} but {refs[block_id]} holders"
                )
        for req in self._waiting:
            if req.status is not RequestStatus.WAITING or req.block_ids or req.num_computed_tokens:
                raise IntegrityError(f"waiting request {req.request_id!r} holds blocks or computed tokens")
        queued = [r.request_id for r in self._waiting] + [r.request_id for r in self._running]
        if len(set(queued)) != len(queued) or set(queued) != set(self._requests):
            raise IntegrityError("the waiting and running queues disagree with the request table")
        if not self._running and self.pool.num_free_blocks != self.num_blocks:
            raise IntegrityError(
                f"idle, yet only {self.pool.num_free_blocks} of {self.num_blocks} blocks are free (a leak)"
            )
