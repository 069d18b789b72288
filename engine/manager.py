"""The continuous-batching manager: one background thread owns the model and runs the loop

    batch = scheduler.schedule(); logits = runner.execute(batch); tokens = sample(batch, logits)
    finished = stop_and_publish(batch, tokens); scheduler.update(batch, tokens, finished)

Requests and cancellations cross into the engine thread through a thread-safe inbox; outputs cross back
onto one queue per request (an asyncio queue for the server, handed over once per loop iteration in one
``loop.call_soon_threadsafe`` for all of them, see engine/request_handle.py; a plain queue for the
synchronous API). Nothing else is shared.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    UnsatisfiableOptionsError,
)
from engine.executor.runner import ModelRunner
from engine.generation.config import DEFAULT_MAX_NEW_TOKENS, GenerationConfig
from engine.generation.request_state import RequestGenerationState
from engine.generation.sampler import SampledToken, Sampler, SamplingRow
from engine.outputs import GenerationOutput, RequestStatus
from engine.request_handle import AsyncSink, RequestHandle, Sink, SyncSink
from engine.stats import EngineStats
from scheduler.base import Scheduler
from scheduler.batch import ScheduledBatch
from scheduler.errors import RequestTooLargeError
from scheduler.request import FinishReason, Request

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Group:
    """One submitted request: ``n`` samples of one prompt."""

    request_id: str
    prompt_ids: list[int]
    config: GenerationConfig
    max_new_tokens: int
    sink: Sink
    streaming: bool
    record_timestamps: bool
    arrival_time: float = field(default_factory=time.monotonic)
    sequences: list[_Sequence] = field(default_factory=list)
    num_finished: int = 0
    forked: bool = False

    @property
    def n(self) -> int:
        return self.config.num_return_sequences


@dataclass(eq=False)
class _Sequence:
    """One sample of a group: the engine's payload on a scheduler ``Request``."""

    group: _Group
    index: int
    gen: RequestGenerationState
    request: Request | None = None
    timestamps: list[float] = field(default_factory=list)
    pending_text: str = ""  # text not yet published
    pending_reason: FinishReason | None = None  # a forking parent's finish, applied after its forks
    sent_ids: int = 0  # generated ids already published
    sent_logprobs: int = 0
    finished: bool = False

    @property
    def scheduler_id(self) -> str:
        return f"{self.group.request_id}#{self.index}"


class ContinuousBatchingManager:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        sampler: Sampler,
        tokenizer: Any,
        generation_defaults: GenerationConfig,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        max_queue: int = 1024,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.generation_defaults = generation_defaults
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.max_queue = max_queue

        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        self._lock = threading.Lock()
        self._num_inbox_adds = 0  # groups submitted but not yet drained by the engine thread
        self._groups: dict[str, _Group] = {}  # unfinished groups, engine thread only
        self._ready: queue.Queue[str] = queue.Queue()
        self._sync_sinks: dict[str, SyncSink] = {}
        self._unflushed: list[Sink] = []  # sinks put to since the last flush, engine thread only
        self._step_observers: list[Callable[[int], None]] = []
        self._finish_observers: list[Callable[[GenerationOutput], None]] = []
        self._stats = self._snapshot(running=False)
        self.num_steps = 0
        # Test-only fault injection: called with the batch before each forward (may raise), and with the
        # batch and its logits after it (may return changed logits, e.g. a NaN row).
        self.fault_hook: Callable[[ScheduledBatch], None] | None = None
        self.logits_hook: Callable[[ScheduledBatch, torch.Tensor], torch.Tensor] | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._dead = None
        self._thread = threading.Thread(target=self._run, name="cbserve-engine", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stop the loop. Requests still unfinished get a final output with status failed."""
        self._stop.set()
        self._wakeup.set()
        if block:
            self.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ submitting
    def submit(
        self,
        prompt_ids: list[int],
        generation_config: GenerationConfig | None = None,
        request_id: str | None = None,
        record_timestamps: bool = True,
    ) -> RequestHandle:
        """Admit a request from a running asyncio loop; its outputs stream through the returned handle."""
        sink = AsyncSink(asyncio.get_running_loop())
        group = self._new_group(prompt_ids, generation_config, request_id, sink, True, record_timestamps)
        self._enqueue(group)
        return RequestHandle(self, group.request_id, group.n, sink)

    def add_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        generation_config: GenerationConfig | None = None,
        **generation_kwargs: Any,
    ) -> str:
        """Admit a request; read its outputs with ``get_result`` or ``request_id_iter``. With
        ``streaming`` every step's output is delivered, otherwise only the final one."""
        config = generation_config or self.generation_defaults
        overrides = dict(generation_kwargs)
        if max_new_tokens is not None:
            overrides["max_new_tokens"] = max_new_tokens
        if overrides:
            config = config.merged(**overrides)
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        sink = SyncSink(rid, self._ready, config.num_return_sequences)
        group = self._new_group(input_ids, config, rid, sink, streaming, record_timestamps)
        self._sync_sinks[rid] = sink
        self._enqueue(group)
        return rid

    def cancel_request(self, request_id: str) -> None:
        """Cancel at the next step: blocks are freed and one final output with status cancelled is sent."""
        self._inbox.put(("cancel", request_id))
        self._wakeup.set()

    def evict_request_from_cache(self, request_id: str) -> None:
        """Drop a finished request's blocks from the prefix cache (they are otherwise kept for reuse)."""
        self._inbox.put(("evict", request_id))
        self._wakeup.set()

    def get_result(self, timeout: float | None = None) -> GenerationOutput | None:
        """The next output of any request added with ``add_request``; None after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                rid = self._ready.get(timeout=remaining)
            except queue.Empty:
                return None
            sink = self._sync_sinks.get(rid)
            if sink is None:
                continue
            try:
                out = sink.queue.get_nowait()
            except queue.Empty:  # NOTE: already consumed through request_id_iter.
                continue
            self._consumed(sink, out)
            return out

    def request_id_iter(self, request_id: str, timeout: float | None = None) -> Iterator[GenerationOutput]:
        """Outputs of one request as they come, until it finishes."""
        sink = self._sync_sinks.get(request_id)
        if sink is None:
            raise KeyError(f"unknown request id {request_id!r}")
        while sink.unread_finals:
            try:
                out = sink.queue.get(timeout=timeout)
            except queue.Empty:
                return
            self._consumed(sink, out)
            yield out

    def _consumed(self, sink: SyncSink, out: GenerationOutput) -> None:
        if out.is_finished:
            sink.unread_finals -= 1
            if sink.unread_finals == 0:
                self._sync_sinks.pop(sink.request_id, None)

    def add_step_observer(self, fn: Callable[[int], None]) -> None:
        """``fn(num_tokens)`` is called from the engine thread after every step."""
        self._step_observers.append(fn)

    def add_finish_observer(self, fn: Callable[[GenerationOutput], None]) -> None:
        """``fn(output)`` is called from the engine thread with every sample's final output (finished,
        cancelled or failed), whether or not anybody reads it."""
        self._finish_observers.append(fn)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        return self._stats

    def num_unfinished(self) -> int:
        with self._lock:
            return self._num_inbox_adds + self._stats.num_requests_running + self._stats.num_requests_waiting

    def check_integrity(self) -> None:
        """Verify the scheduler and allocator; call only while the loop is idle or stopped."""
        self.scheduler.check_integrity()

    # ------------------------------------------------------------------ admission (caller's thread)
    def _new_group(
        self,
        prompt_ids: list[int],
        config: GenerationConfig | None,
        request_id: str | None,
        sink: Sink,
        streaming: bool,
        record_timestamps: bool,
    ) -> _Group:
        if self._dead is not None or not self.is_running():
            raise EngineDeadError(f"the engine loop is not running{self._death_reason()}")
        config = config or self.generation_defaults
        config.validate(vocab_size=self.vocab_size)
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty: at least one token is needed", param="prompt")
        bad = [t for t in prompt_ids if not isinstance(t, int) or t < 0 or t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})", param="prompt"
            )
        room = self.max_model_len - len(prompt_ids)
        max_new = config.max_new_tokens
        if max_new is None:
            max_new = min(DEFAULT_MAX_NEW_TOKENS, max(room, 0))
        if len(prompt_ids) + max(max_new, 1) > self.max_model_len:
            raise ContextLengthExceededError(len(prompt_ids), max_new, self.max_model_len)
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        total = len(prompt_ids) + max_new
        needed = math.ceil(total / self.scheduler.block_size)
        if needed > self.scheduler.num_blocks:
            raise RequestTooLargeError(
                rid,
                total,
                needed,
                self.scheduler.num_blocks,
                f"{len(prompt_ids)} prompt tokens + {max_new} new tokens need {needed} KV blocks but the cache "
                f"holds only {self.scheduler.num_blocks}",
            )
        group = _Group(rid, prompt_ids, config, max_new, sink, streaming, record_timestamps)
        return group

    def _enqueue(self, group: _Group) -> None:
        with self._lock:
            waiting = self._num_inbox_adds + self._stats.num_requests_waiting
            if waiting >= self.max_queue:
                raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests); retry later")
            self._num_inbox_adds += 1
        self._inbox.put(("add", group))
        self._wakeup.set()

    def _death_reason(self) -> str:
        return f": {self._dead!r}" if self._dead is not None else ""

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                self._flush_outputs()
                if not self.scheduler.has_unfinished_requests():
                    self._publish_stats()
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                self.step()
                self._flush_outputs()
        except BaseException as exc:  # NOTE: a bug in the loop itself: make it visible, fail everyone.
            logger.exception("engine loop died")
            self._dead = exc
        finally:
            self._stop.set()
            self._fail_everything("the engine stopped" + self._death_reason())
            self._flush_outputs()
            self._publish_stats(running=False)

    def step(self) -> None:
        """One iteration: schedule, forward, sample, stop, update, publish."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            self._publish_stats()
            self._wakeup.wait(timeout=0.01)
            self._wakeup.clear()
            return
        try:
            if self.fault_hook is not None:
                self.fault_hook(batch)
            logits = self.runner.execute(batch)
            if self.logits_hook is not None:
                logits = self.logits_hook(batch, logits)
            sampled = self._sample(batch, logits)
        except Exception as exc:
            logger.exception("forward failed; failing the %d requests of this step", len(batch))
            for s in batch.requests:
                self._fail_sequence(s.request.payload, f"the model's forward failed: {exc!r}")
            self._publish_stats()
            return
        self._advance(batch, sampled)
        self.num_steps += 1
        for fn in self._step_observers:
            fn(batch.num_tokens)
        self._publish_stats()

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[list[SampledToken]]:
        """One SampledToken per sampling row; a group's first sample expands to its ``n`` rows (fork)."""
        rows: list[SamplingRow] = []
        row_logits: list[int] = []
        spans: list[tuple[int, int]] = []
        li = 0
        for s in batch.requests:
            if not s.needs_sample:
                continue
            seq: _Sequence = s.request.payload
            seqs = [seq]
            if self._forks_now(seq):
                seqs += self._children(seq.group)
            start = len(rows)
            for child in seqs:
                rows.append(child.gen.sampling_row())
                row_logits.append(li)
            spans.append((start, len(rows)))
            li += 1
        if not rows:
            return []
        if row_logits != list(range(logits.shape[0])):  # forks repeat a row; skipped rows drop one
            logits = logits.index_select(0, torch.tensor(row_logits, device=logits.device))
        tokens = self.sampler.sample(logits, rows)
        return [tokens[a:b] for a, b in spans]

    def _forks_now(self, seq: _Sequence) -> bool:
        group = seq.group
        return group.n > 1 and not group.forked and seq.index == 0

    def _children(self, group: _Group) -> list[_Sequence]:
        children = group.sequences[1:]
        if not children:
            for i in range(1, group.n):
                children.append(_Sequence(group, i, self._generation_state(group, i)))
            group.sequences.extend(children)
        return children

    def _advance(self, batch: ScheduledBatch, sampled: list[list[SampledToken]]) -> None:
        """Stopping, scheduler update, publishing and forks for the tokens of one step."""
        now = time.monotonic()
        new_tokens: dict[str, int] = {}
        finished: dict[str, FinishReason] = {}
        forks: list[tuple[_Sequence, list[tuple[_Sequence, SampledToken]]]] = []
        touched: list[_Sequence] = []
        it = iter(sampled)
        for s in batch.requests:
            if not s.needs_sample:
                continue
            tokens = next(it)
            seq: _Sequence = s.request.payload
            try:
                reason = self._accept(seq, tokens[0], now)
            except UnsatisfiableOptionsError as exc:
                self._fail_sequence(seq, str(exc), UnsatisfiableOptionsError.code)
                continue
            except Exception as exc:  # NOTE: one request's failure must not take the batch down.
                logger.exception("request %s failed", seq.scheduler_id)
                self._fail_sequence(seq, f"{exc!r}")
                continue
            new_tokens[seq.scheduler_id] = tokens[0].token_id
            touched.append(seq)
            if len(tokens) > 1:
                seq.group.forked = True
                forks.append((seq, list(zip(self._children(seq.group), tokens[1:], strict=True))))
            if reason is not None:
                seq.finished = True
                if len(tokens) > 1:  # NOTE: the parent's blocks must outlive this step's forks.
                    seq.pending_reason = reason
                else:
                    finished[seq.scheduler_id] = reason
        self.scheduler.update(batch, new_tokens, finished)
        for parent, children in forks:
            self._fork(parent, children, now)
        for seq in touched:
            self._publish(seq)

    def _accept(self, seq: _Sequence, tok: SampledToken, now: float) -> FinishReason | None:
        if tok.error is not None:
            raise UnsatisfiableOptionsError(tok.error) if tok.error_from_options else RuntimeError(tok.error)
        result = seq.gen.on_token(tok.token_id, tok.logprob, now)
        seq.pending_text += result.delta_text
        seq.timestamps.append(now)
        return result.finish_reason

    def _fork(self, parent: _Sequence, children: list[tuple[_Sequence, SampledToken]], now: float) -> None:
        assert parent.request is not None
        for child, tok in children:
            try:
                reason = self._accept(child, tok, now)
            except UnsatisfiableOptionsError as exc:
                self._fail_sequence(child, str(exc), UnsatisfiableOptionsError.code)
                continue
            except Exception as exc:
                self._fail_sequence(child, f"{exc!r}")
                continue
            if reason is not None:
                child.finished = True
                self._publish(child, finish_reason=reason)
                continue
            req = Request(
                request_id=child.scheduler_id,
                prompt_ids=child.group.prompt_ids,
                max_new_tokens=child.group.max_new_tokens,
                arrival_time=child.group.arrival_time,
                output_ids=[tok.token_id],
                payload=child,
            )
            child.request = self.scheduler.fork(parent.scheduler_id, req)
            self._publish(child)
        if parent.pending_reason is not None:
            self.scheduler.finish_request(parent.scheduler_id, parent.pending_reason)

    # ------------------------------------------------------------------ inbox (engine thread)
    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                with self._lock:
                    self._num_inbox_adds -= 1
                self._admit(item)
            elif kind == "cancel":
                self._cancel(item)
            elif kind == "evict":
                i = 0  # the scheduler knows each sample as "{id}#{index}"
                while self.scheduler.evict_request_from_cache(f"{item}#{i}") is not None:
                    i += 1

    def _admit(self, group: _Group) -> None:
        seq = _Sequence(group, 0, self._generation_state(group, 0))
        group.sequences.insert(0, seq)
        req = Request(
            request_id=seq.scheduler_id,
            prompt_ids=group.prompt_ids,
            max_new_tokens=group.max_new_tokens,
            arrival_time=group.arrival_time,
            payload=seq,
        )
        seq.request = req
        self._groups[group.request_id] = group
        try:
            self.scheduler.add_request(req)
        except Exception as exc:
            self._fail_sequence(seq, str(exc))

    def _cancel(self, request_id: str) -> None:
        group = self._groups.get(request_id)
        if group is None:
            return
        for seq in list(group.sequences):
            if seq.finished:
                continue
            if seq.request is not None:
                self.scheduler.finish_request(seq.scheduler_id, FinishReason.ABORT)
            seq.finished = True
            self._publish(seq, status=RequestStatus.CANCELLED, finish_reason=FinishReason.ABORT)
        # samples never forked (cancelled before the prompt finished) still owe their final output
        for i in range(len(group.sequences), group.n):
            seq = _Sequence(group, i, self._generation_state(group, i), finished=True)
            group.sequences.append(seq)
            self._publish(seq, status=RequestStatus.CANCELLED, finish_reason=FinishReason.ABORT)

    def _fail_sequence(self, seq: _Sequence, error: str, error_code: str | None = None) -> None:
        if seq.finished:
            return
        if seq.request is not None and not seq.request.is_finished:
            self.scheduler.finish_request(seq.scheduler_id, FinishReason.ERROR)
        seq.finished = True
        self._publish(
            seq, status=RequestStatus.FAILED, finish_reason=FinishReason.ERROR, error=error, error_code=error_code
        )
        # a failed first sample takes its unforked siblings down with it
        group = seq.group
        if seq.index == 0 and not group.forked and group.n > 1:
            group.forked = True
            for child in self._children(group):
                if not child.finished:
                    child.finished = True
                    self._publish(
                        child,
                        status=RequestStatus.FAILED,
                        finish_reason=FinishReason.ERROR,
                        error=error,
                        error_code=error_code,
                    )

    def _fail_everything(self, error: str) -> None:
        while True:  # requests still in the inbox
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                with self._lock:
                    self._num_inbox_adds -= 1
                self._groups[item.request_id] = item
                item.sequences.insert(0, _Sequence(item, 0, self._generation_state(item, 0)))
        for group in list(self._groups.values()):
            for seq in list(group.sequences):
                try:
                    self._fail_sequence(seq, error)
                except Exception:  # NOTE: the scheduler may be broken too; the client must still hear.
                    seq.finished = True
                    self._publish(
                        seq, status=RequestStatus.FAILED, finish_reason=FinishReason.ERROR, error=error
                    )

    # ------------------------------------------------------------------ publishing (engine thread)
    def _publish(
        self,
        seq: _Sequence,
        status: RequestStatus | None = None,
        finish_reason: FinishReason | None = None,
        error: str | None = None,
        error_code: str | None = None,
    ) -> None:
        group = seq.group
        req = seq.request
        reason = finish_reason or seq.pending_reason or (req.finish_reason if req is not None else None)
        if status is None:
            status = RequestStatus.FINISHED if seq.finished else RequestStatus.RUNNING
        done = status is not RequestStatus.RUNNING
        if done and reason is not None:  # NOTE: releases text held back for a possible stop string
            seq.pending_text += seq.gen.finish(reason).delta_text
        if not done and not group.streaming:
            return
        ids = list(seq.gen.output_ids)
        delta_ids = ids[seq.sent_ids :]
        logprobs = seq.gen.logprobs if group.config.output_logprobs else None
        delta_lp = logprobs[seq.sent_logprobs :] if logprobs is not None else None
        out = GenerationOutput(
            request_id=group.request_id,
            prompt_ids=group.prompt_ids,
            generated_ids=ids,
            status=status,
            finish_reason=reason if done else None,
            error=error,
            error_code=error_code,
            index=seq.index,
            text=seq.gen.text,
            delta_text=seq.pending_text,
            delta_ids=delta_ids,
            logprobs=list(logprobs) if logprobs is not None else None,
            delta_logprobs=delta_lp,
            timestamps=list(seq.timestamps) if group.record_timestamps else None,
            arrival_time=group.arrival_time,
            first_scheduled_time=req.first_scheduled_time if req is not None else None,
            first_token_time=seq.timestamps[0] if seq.timestamps else None,
            finish_time=time.monotonic() if done else None,
            num_cached_tokens=req.num_cached_tokens if req is not None else 0,
            num_preemptions=req.num_preemptions if req is not None else 0,
        )
        seq.sent_ids = len(ids)
        seq.pending_text = ""
        seq.sent_logprobs = len(logprobs) if logprobs is not None else 0
        if done:
            for fn in self._finish_observers:
                try:
                    fn(out)
                except Exception:  # NOTE: an observer's bug must not take the engine down.
                    logger.exception("finish observer failed")
            group.num_finished += 1
            if group.num_finished >= group.n:
                self._groups.pop(group.request_id, None)
        group.sink.put(out)
        self._unflushed.append(group.sink)

    def _flush_outputs(self) -> None:
        """Hand over what this iteration published: one wake-up per event loop, not one per output."""
        sinks, self._unflushed = self._unflushed, []
        for sink in sinks:
            sink.flush()

    def _generation_state(self, group: _Group, index: int) -> RequestGenerationState:
        return RequestGenerationState(
            group.config,
            group.prompt_ids,
            self.tokenizer,
            self.eos_token_ids,
            sample_index=index,
            max_new_tokens=group.max_new_tokens,
            start_time=group.arrival_time,
        )

    def _snapshot(self, running: bool) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_requests_running=s.num_running,
            num_requests_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage(),
            num_blocks=s.num_blocks,
            block_size=s.block_size,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            is_running=running,
        )

    def _publish_stats(self, running: bool = True) -> None:
        self._stats = self._snapshot(running=running and not self._stop.is_set())
