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
to be recomputed like a prompt), together with the running requests of its ``gang`` (a beam search's
beams); if that preempted the request itself, it yields. Waiting requests are admitted
in arrival order (no skipping ahead) while blocks, the safety margin, the token budget and ``max_num_seqs``
allow, and not in a step that preempted (admitting then would only thrash).

The scheduler keeps the queues and the budgets only: every KV action (block tables, prefix-cache hits,
copy-on-write forks, freeing) goes through ``kvcache.KVCacheManager``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping, Sequence

from kvcache.errors import IntegrityError
from kvcache.manager import NO_PREFIX, KVCacheManager
from kvcache.sizing import blocks_for_tokens
from scheduler.batch import ScheduledBatch, ScheduledRequest
from scheduler.capacity import check_fits_cache
from scheduler.config import SchedulerConfig
from scheduler.errors import RequestTooLargeError
from scheduler.request import FinishReason, Request, RequestStatus

_ADMITTED = (RequestStatus.PREFILLING, RequestStatus.DECODING)


class Scheduler(ABC):
    """Decides, each step, which requests compute how many tokens; their blocks are ``kv_manager``'s.

    Call order per step (the engine thread only; not thread-safe):
    ``batch = schedule()``; the engine runs it; ``update(batch, new_tokens, finished)``. ``add_request``,
    ``finish_request`` and ``fork`` may be called between steps.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_manager = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            record_events=config.enable_kv_cache_events,
        )
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # in admission order: the last was admitted most recently
        self._requests: dict[str, Request] = {}  # every unfinished request, waiting or running
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
        return self.kv_manager.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, tokens served from the cache, total."""
        return self.kv_manager.prefix_cache_hits

    def has_unfinished_requests(self) -> bool:
        return bool(self._waiting or self._running)

    def kv_cache_usage(self) -> float:
        """Fraction of blocks referenced by running requests (cached-but-free blocks count as free)."""
        return self.kv_manager.usage

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table ([] while it waits): read only."""
        return self.kv_manager.block_table(request_id)

    @property
    def waiting_requests(self) -> tuple[Request, ...]:
        return tuple(self._waiting)

    @property
    def running_requests(self) -> tuple[Request, ...]:
        return tuple(self._running)

    # ---- adding ---------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a new request (at the back of the waiting queue).

        Raises ``RequestTooLargeError`` when it can never fit (``check_fits``) and ``ValueError`` for a
        malformed one.
        """
        self._validate_new(req)
        if req.status is not RequestStatus.WAITING or req.num_computed_tokens:
            raise ValueError(f"request {req.request_id!r} must be new: WAITING, nothing computed")
        self._requests[req.request_id] = req
        self._waiting.append(req)

    def check_fits(self, request_id: str, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise ``RequestTooLargeError`` when a request of this size could never run: its prompt plus
        ``max_new_tokens`` needs more KV blocks than the whole cache holds, or exceeds ``max_model_len``."""
        check_fits_cache(request_id, num_prompt_tokens, max_new_tokens, self.block_size, self.num_blocks)
        total = num_prompt_tokens + max_new_tokens
        limit = self.config.max_model_len
        if limit is not None and total > limit:
            raise RequestTooLargeError(
                request_id,
                total,
                blocks_for_tokens(total, self.block_size),
                self.num_blocks,
                f"{num_prompt_tokens} prompt tokens + {max_new_tokens} new tokens exceed max_model_len={limit}",
            )

    def _validate_new(self, req: Request) -> None:
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in the scheduler")
        if not req.prompt_ids:
            raise ValueError(f"request {req.request_id!r} has an empty prompt")
        if req.max_new_tokens < 1:
            raise ValueError(
                f"request {req.request_id!r}: max_new_tokens must be >= 1, got {req.max_new_tokens}"
            )
        self.check_fits(req.request_id, len(req.prompt_ids), req.max_new_tokens)

    # ---- one step -------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Build this step's batch: running requests in the policy's order, then waiting ones by arrival."""
        batch = ScheduledBatch()
        chunks: dict[str, ScheduledRequest] = {}  # insertion order is the batch order
        budget = self.config.max_batch_tokens
        prefill_budget = self._prefill_budget()  # of those, prompt tokens (chunks of prefills)
        prefills: dict[str, int] = {}  # this step's prefill chunks: their tokens
        preempted = False

        for req in self.order_running(self._running):
            if req.status is RequestStatus.WAITING:
                continue  # preempted earlier in this loop to make room for another
            if len(chunks) >= self.config.max_num_seqs or budget == 0:
                break
            drafts = self._schedulable_drafts(req, budget)
            known = req.num_uncomputed_tokens
            if req.status is not RequestStatus.DECODING:
                known = min(known, prefill_budget)
            num_new = min(known, budget) + len(drafts)
            if num_new <= 0:
                continue
            num_tokens = req.num_computed_tokens + num_new
            if drafts and not self.kv_manager.can_allocate_slots(req.request_id, num_tokens):
                num_new, num_tokens, drafts = num_new - len(drafts), num_tokens - len(drafts), ()
            while not self.kv_manager.can_allocate_slots(req.request_id, num_tokens):
                for victim in self._gang_of(self._running[-1]):
                    dropped = chunks.pop(victim.request_id, None)
                    if dropped is not None:
                        budget += dropped.num_tokens
                        prefill_budget += prefills.pop(victim.request_id, 0)
                    self._preempt(victim, batch)
                preempted = True
                if req.status is RequestStatus.WAITING:
                    break
            if req.status is RequestStatus.WAITING:
                continue
            self.kv_manager.allocate_slots(req.request_id, num_tokens)
            chunks[req.request_id] = self._chunk(req, num_new, drafts)
            budget -= num_new
            if req.status is not RequestStatus.DECODING:
                prefills[req.request_id] = num_new
                prefill_budget -= num_new

        if not preempted:
            self._admit_waiting(chunks, min(budget, prefill_budget))

        batch.requests = list(chunks.values())
        # The engine copies before this step's forward (copy-on-write of forks scheduled for the first time).
        batch.blocks_to_copy = self.kv_manager.take_pending_copies(chunks)
        return batch

    def _prefill_budget(self) -> int:
        """The prompt tokens this step may compute: ``max_mixed_prefill_tokens`` while a request decodes."""
        cap = self.config.max_mixed_prefill_tokens
        if cap is not None and any(r.status is RequestStatus.DECODING for r in self._running):
            return cap
        return self.config.max_batch_tokens

    def _admit_waiting(self, chunks: dict[str, ScheduledRequest], budget: int) -> int:
        """Admit waiting requests in arrival order while everything allows; returns the budget left."""
        while (
            self._waiting
            and budget > 0
            and len(chunks) < self.config.max_num_seqs
            and len(self._running) < self.config.max_num_seqs
        ):
            req = self._waiting[0]
            # NOTE: positions served from the prefix cache have no logits: a request that wants its
            # prompt's logits (or hidden states) computes the whole prompt (its blocks are still cached for
            # others).
            cached = (
                NO_PREFIX
                if req.wants_prompt_logits or req.wants_prompt_hidden
                else self.kv_manager.get_computed_blocks(req.request_id, req.all_token_ids)
            )
            num_new = min(req.num_tokens - cached.num_tokens, budget)
            # NOTE: the safety margin keeps room for the running requests to grow; a lone request ignores it.
            reserved = self.config.num_reserved_blocks if self._running else 0
            num_tokens = cached.num_tokens + num_new
            if not self.kv_manager.can_allocate_slots(req.request_id, num_tokens, cached, reserved):
                break

            self._waiting.popleft()
            self.kv_manager.allocate_slots(req.request_id, num_tokens, cached)
            req.num_computed_tokens = cached.num_tokens
            req.num_cached_tokens = cached.num_tokens
            self._running.append(req)
            chunks[req.request_id] = self._chunk(req, num_new)
            budget -= num_new
        return budget

    def _schedulable_drafts(self, req: Request, budget: int) -> tuple[int, ...]:
        """The request's drafts that this step can verify: only a decoding request's (one known token to
        compute), as many as the token budget leaves after that token, and never so many that accepting
        them all would pass ``max_new_tokens`` (the cache is sized for that) or ``max_model_len``."""
        if not req.draft_ids or req.num_uncomputed_tokens != 1 or req.wants_prompt_logits:
            return ()
        room = req.max_new_tokens - len(req.output_ids) - 1
        limit = self.config.max_model_len
        if limit is not None:
            room = min(room, limit - req.num_tokens - 1)
        return tuple(req.draft_ids[: max(min(room, budget - 1), 0)])

    def _chunk(self, req: Request, num_new: int, drafts: tuple[int, ...] = ()) -> ScheduledRequest:
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self._refresh_status(req)
        return ScheduledRequest(
            request=req,
            start=req.num_computed_tokens,
            num_tokens=num_new,
            block_ids=self.kv_manager.block_table(req.request_id),
            draft_ids=drafts,
        )

    def update(
        self,
        batch: ScheduledBatch,
        new_tokens: Mapping[str, int | Sequence[int]],
        finished: Mapping[str, FinishReason],
    ) -> list[Request]:
        """Apply a step's results: advance each scheduled request by its chunk, append the tokens accepted
        for each chunk that ``needs_sample`` (one sampled token, or a list: with drafts, the drafts it accepted
        then one sampled token), then finish the requests in ``finished`` (free their blocks; their full blocks stay
        in the prefix cache). Returns the requests finished by this call.

        Speculative decoding: the KV of the accepted drafts is kept, the rejected drafts' slots are rolled
        back (``KVCacheManager.truncate``), and every request's drafts are cleared (the engine proposes
        new ones for the next step).

        Stopping is the engine's: a request ends only through ``finished`` or ``finish_request`` (so the
        engine may keep a finished parent alive until it has forked its n > 1 siblings). The cache is sized
        for ``len(prompt) + max_new_tokens``, so the engine must stop each request by then. A request that
        needed a sample but got none (and did not finish) recomputes its last token next step.
        """
        for chunk in batch.requests:
            self._advance(chunk, new_tokens, finished)
        done: list[Request] = []
        for request_id, reason in finished.items():
            ended = self._finish(request_id, reason)
            if ended is not None:
                done.append(ended)
        return done

    def _advance(
        self,
        chunk: ScheduledRequest,
        new_tokens: Mapping[str, int | Sequence[int]],
        finished: Mapping[str, FinishReason],
    ) -> None:
        """Move one scheduled request past its chunk and register its newly computed full blocks."""
        req = chunk.request
        if req.status not in _ADMITTED or self._requests.get(req.request_id) is not req:
            return  # finished (cancelled) between schedule() and update()
        if chunk.start != req.num_computed_tokens:
            raise IntegrityError(
                f"request {req.request_id!r}: batch chunk starts at {chunk.start} but "
                f"{req.num_computed_tokens} tokens are computed"
            )
        sample_due = chunk.needs_sample  # NOTE: read before appending, which moves num_tokens
        drafts = chunk.draft_ids
        req.num_computed_tokens = chunk.end - len(drafts)
        req.draft_ids = []
        if sample_due:
            new = new_tokens.get(req.request_id)
            tokens = [new] if isinstance(new, int) else list(new or ())
            if tokens:
                num_accepted = (
                    len(tokens) - 1
                )  # drafts whose KV this chunk computed (the last token's is not)
                if num_accepted > len(drafts) or tokens[:num_accepted] != list(drafts[:num_accepted]):
                    raise IntegrityError(
                        f"request {req.request_id!r}: accepted tokens {list(tokens)} do not extend its drafts "
                        f"{list(drafts)}"
                    )
                req.output_ids.extend(tokens)
                req.num_computed_tokens += num_accepted
            elif req.request_id not in finished:
                # NOTE: with nothing sampled, the last token must run again to give logits.
                req.num_computed_tokens -= 1
        if drafts:
            self.kv_manager.truncate(req.request_id, req.num_computed_tokens)  # the rejected drafts' slots
        self.kv_manager.cache_computed(req.request_id, req.num_computed_tokens, lambda: req.all_token_ids)
        self._refresh_status(req)

    # ---- removing -------------------------------------------------------------------------------------
    def finish_request(self, request_id: str, reason: FinishReason) -> Request | None:
        """Remove a waiting or running request now (cancel, error) and free its blocks. None if unknown."""
        return self._finish(request_id, reason)

    def _finish(self, request_id: str, reason: FinishReason) -> Request | None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            self._waiting.remove(req)
        else:
            self._running.remove(req)
        self.kv_manager.remove(request_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        return req

    def recently_finished_ids(self) -> list[str]:
        """The finished requests whose blocks ``evict_request_from_cache`` can still drop."""
        return self.kv_manager.finished_request_ids()

    def evict_request_from_cache(self, request_id: str) -> int | None:
        """Drop a finished request's blocks from the prefix cache (those no running request shares).
        Returns how many were dropped; None when the request is not among the recently finished."""
        return self.kv_manager.evict_finished(request_id)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (nothing changed) while any request holds blocks."""
        return self.kv_manager.reset_prefix_cache()

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        """Preempt by recompute: free the blocks, back to the front of the waiting queue, output kept."""
        self._running.remove(req)
        self.kv_manager.free(req.request_id)
        req.num_computed_tokens = 0
        req.draft_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(req)
        batch.preempted_ids.append(req.request_id)

    def _gang_of(self, req: Request) -> list[Request]:
        """``req`` and the running requests of its gang, the most recently admitted first."""
        if req.gang is None:
            return [req]
        return [r for r in reversed(self._running) if r.gang == req.gang]

    # ---- n > 1 ----------------------------------------------------------------------------------------
    def fork(self, parent_id: str, child: Request) -> Request:
        """Add ``child`` (a new request whose tokens start with the parent's computed tokens) sharing the
        parent's KV (``KVCacheManager.fork``: full blocks shared, the last partial block copied through
        ``blocks_to_copy`` of the next batch that schedules the child). When no block is free (or the parent
        has computed nothing yet) the child waits and recomputes instead; the prefix cache then shares the
        full blocks. Raises ``KeyError`` for an unknown parent."""
        parent = self._requests.get(parent_id)
        if parent is None:
            raise KeyError(f"cannot fork unknown request {parent_id!r}")
        self._validate_new(child)
        # The child must keep one token to compute (its logits give its next token).
        num_shared = min(parent.num_computed_tokens, child.num_tokens - 1)
        if child.all_token_ids[:num_shared] != parent.all_token_ids[:num_shared]:
            raise ValueError(
                f"forked request {child.request_id!r} does not start with the {num_shared} computed tokens of "
                f"{parent_id!r}"
            )
        self._requests[child.request_id] = child
        child.num_computed_tokens = 0
        if (
            parent.status not in _ADMITTED
            or num_shared == 0
            or not self.kv_manager.fork(parent_id, child.request_id, num_shared)
        ):
            child.status = RequestStatus.WAITING
            if parent.status is RequestStatus.WAITING:
                # Right behind its parent, so the parent's blocks are cached by the time the child comes.
                self._waiting.insert(self._waiting.index(parent) + 1, child)
            else:
                self._waiting.appendleft(child)  # a sibling of a running request: next in line
            return child
        child.num_computed_tokens = num_shared
        self._running.append(child)
        self._refresh_status(child)
        return child

    def _refresh_status(self, req: Request) -> None:
        decoding = req.num_computed_tokens >= len(req.prompt_ids) and req.num_uncomputed_tokens <= 1
        req.status = RequestStatus.DECODING if decoding else RequestStatus.PREFILLING

    # ---- invariants -----------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` when the KV manager, the queues and the requests disagree."""
        self.kv_manager.check_integrity()
        for req in self._running:
            if req.status not in _ADMITTED:
                raise IntegrityError(f"running request {req.request_id!r} has status {req.status}")
            num_blocks = len(self.kv_manager.block_table(req.request_id))
            if num_blocks < blocks_for_tokens(req.num_computed_tokens, self.block_size):
                raise IntegrityError(
                    f"request {req.request_id!r} holds {num_blocks} blocks for "
                    f"{req.num_computed_tokens} computed tokens"
                )
            if not 0 <= req.num_computed_tokens <= req.num_tokens:
                raise IntegrityError(f"request {req.request_id!r} computed {req.num_computed_tokens} tokens")
        for req in self._waiting:
            if req.status is not RequestStatus.WAITING or req.num_computed_tokens:
                raise IntegrityError(f"waiting request {req.request_id!r} holds computed tokens")
        if not self.kv_manager.request_ids <= {r.request_id for r in self._running}:
            raise IntegrityError("requests that are not running hold blocks (a leak)")
        queued = [r.request_id for r in self._waiting] + [r.request_id for r in self._running]
        if len(set(queued)) != len(queued) or set(queued) != set(self._requests):
            raise IntegrityError("the waiting and running queues disagree with the request table")
