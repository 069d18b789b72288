"""The engine loop: one background thread owns the model and runs

    batch = scheduler.schedule(); plan = SamplingPlan.of(batch)
    with sampler.masks_ahead(plan.rows) as masks:     # grammar masks on a worker, during the forward
        logits = executor.execute(batch); tokens = plan.sample(sampler, logits, masks)
        beams.search(logits)                          # beam searches: engine/beam_group.py
        contrast.search(logits, hidden)               # contrastive searches: engine/contrastive_group.py
    step = outputs.accept_step(batch, tokens); verify_drafts(...)   # speculating rows accept their drafts
    scheduler.update(batch, step..., beams...); outputs.publish(...); speculator.propose(running)
    beams.apply(scheduler); contrast.apply(...)       # forks and prunes; finished searches published

between draining its inbox (new requests, cancellations, evictions, cache resets) and flushing the step's
outputs to their sinks in one hand-over; the KV-cache events of the step (kvcache/events.py), when recorded,
go to their observers then too. A forward (or sampling) that raises fails only that step's requests; a bug
in the loop itself fails every request and stops the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.beam_group import BeamSteps, publish_results
from engine.contrastive_group import ContrastiveSteps
from engine.errors import ExecutorFailedError
from engine.generation.mask_prefetch import PendingMasks
from engine.generation.sampler import SampledToken, Sampler, SamplingRow
from engine.inbox import AddRequest, CancelRequest, EvictRequest, Inbox, InboxMessage, ResetPrefixCache
from engine.output_processor import OutputProcessor
from engine.sequence_group import Sequence, SequenceGroup
from engine.speculative.speculator import Speculator
from engine.speculative.verifier import VerifyRun, num_accepted, verify_drafts
from engine.stats import EngineStats
from kvcache.events import KVCacheEvent
from scheduler.base import Scheduler
from scheduler.batch import ScheduledBatch
from scheduler.request import FinishReason

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # nothing to run: sleep until a message arrives, or this long
# several requests reaching an idle engine: start once none has come for this long (at most ARRIVAL_CAP times)
ARRIVAL_WINDOW_S = 0.003
ARRIVAL_CAP = 10
STALLED_WAIT_S = 0.01  # requests wait but none can be scheduled (blocks in use): retry this soon


class Executor(Protocol):
    """Runs one batch through the model (engine/executor/runner.py's ``ModelRunner``). An executor that can
    fail for good (a sharded model's, engine/executor/parallel/runner.py) also has ``check_alive()``,
    called at every iteration; ``ExecutorFailedError`` from it or from ``execute`` stops the loop."""

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits ``[sum of num_logits_rows, vocab]`` (float32): each chunk's ``num_logits_rows`` last rows,
        in batch order (one for a chunk that ``needs_sample``; every row of a prompt-logprobs chunk)."""
        ...


def take_hidden_states(executor: Executor) -> torch.Tensor:
    """The final hidden states of the last batch's chunks that asked (``num_hidden_rows`` each, batch
    order): executors whose ``supports_hidden_states`` is true give them (``take_hidden_states()``); the
    manager admits contrastive search only then."""
    take: Callable[[], torch.Tensor] = getattr(executor, "take_hidden_states")  # noqa: B009
    return take()


@dataclass(frozen=True)
class SamplingPlan:
    """Who samples from which logits row in a step: ``rows[k]`` samples from row ``row_logits[k]``; chunk
    ``j`` of those that ``needs_sample`` owns ``rows[spans[j][0]:spans[j][1]]`` (several at a group's
    fan-out). Known before the forward, so that the grammar masks can start then."""

    rows: list[SamplingRow]
    row_logits: list[int]
    spans: list[tuple[int, int]]

    @classmethod
    def of(cls, batch: ScheduledBatch) -> SamplingPlan:
        rows: list[SamplingRow] = []
        row_logits: list[int] = []
        spans: list[tuple[int, int]] = []
        for li, chunk in enumerate(chunk for chunk in batch.requests if chunk.needs_sample):
            seq: Sequence = chunk.request.payload
            start = len(rows)
            for sampling in seq.group.sampling(seq):
                rows.append(sampling.gen.sampling_row())
                row_logits.append(li)
            spans.append((start, len(rows)))
        return cls(rows, row_logits, spans)

    def sample(self, sampler: Sampler, logits: torch.Tensor, masks: PendingMasks) -> list[list[SampledToken]]:
        """Per chunk that ``needs_sample``, its SampledTokens, from ``logits`` (one row per such chunk)."""
        if not self.rows:
            return [[] for _ in self.spans]
        if self.row_logits != list(range(logits.shape[0])):  # forks repeat a row; skipped rows drop one
            logits = logits.index_select(0, torch.tensor(self.row_logits, device=logits.device))
        tokens = sampler.sample(logits, self.rows, masks)
        return [tokens[a:b] for a, b in self.spans]


class EngineLoop:
    """The engine thread's state and its loop. ``run`` until ``stopping`` is set."""

    def __init__(
        self, scheduler: Scheduler, executor: Executor, sampler: Sampler, speculator: Speculator | None = None
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.sampler = sampler
        self.speculator = speculator if speculator is not None else Speculator()
        self.inbox = Inbox()
        self.outputs = OutputProcessor()
        self.stopping = threading.Event()
        self.dead: BaseException | None = None  # what killed the loop, if anything did
        self.step_observers: list[Callable[[int], None]] = []
        self.kv_event_observers: list[Callable[[list[KVCacheEvent]], None]] = []
        self.num_steps = 0
        self.stats = self._snapshot(running=False)
        self.arrival_window_s = ARRIVAL_WINDOW_S  # 0: an idle engine starts on the first arrivals it sees

    # ------------------------------------------------------------------ the thread
    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self._check_executor()
                self._gather_arrivals(self._drain_inbox())
                self._publish_kv_events()
                self.outputs.flush()
                if not self.scheduler.has_unfinished_requests():
                    self._idle(IDLE_WAIT_S)
                    continue
                self.step()
                self.outputs.flush()
        except BaseException as exc:  # NOTE: a bug in the loop itself: make it visible, fail everyone.
            logger.exception("engine loop died")
            self.dead = exc
        finally:
            self.stopping.set()
            self._fail_everything("the engine stopped" + self.death_reason())
            self.outputs.flush()
            self._publish_stats(running=False)

    def step(self) -> None:
        """One iteration: schedule, execute (the grammar masks computed meanwhile), sample, update the
        scheduler, publish."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            self._idle(STALLED_WAIT_S)
            return
        plan = SamplingPlan.of(batch)
        beams = BeamSteps.of(batch)
        contrast = ContrastiveSteps.of(batch)
        hidden = None
        with self.sampler.masks_ahead(plan.rows) as masks:
            try:
                logits = self.executor.execute(batch)
                if contrast.num_hidden_rows:
                    hidden = take_hidden_states(self.executor)
                logits, runs = self._take_draft_logits(batch, self._take_prompt_logits(batch, logits))
                sampled = plan.sample(self.sampler, logits, masks)
                beams.search(logits, self.sampler.vocab_size, self.sampler.eos_token_ids)
                contrast.search(logits, hidden, self.sampler, self.outputs, time.monotonic())
            except ExecutorFailedError:
                raise  # NOTE: no step can run any more: the loop dies (run() fails every request).
            except Exception as exc:  # NOTE: a failed forward fails its step's requests, not the engine.
                self._fail_step(batch, exc)
                return
        step = self.outputs.accept_step(batch, sampled, time.monotonic())
        if runs:
            verify_drafts(self.sampler, self.outputs, runs, step)
            for run in runs:
                self.speculator.record(run.seq.draft_length, len(run.drafts), num_accepted(run, step))
        for failure in [*step.failed, *beams.failed, *contrast.failed]:
            self._fail(failure.seq, failure.error, failure.code)
        self.scheduler.update(
            batch, {**step.new_tokens, **beams.new_tokens, **contrast.new_tokens}, step.finished
        )
        for parent, children in step.forks:
            self._fork(parent, children, step.now)
        for seq in step.accepted:
            self.outputs.publish(seq)
        for group in beams.apply(self.scheduler):
            publish_results(group, self.outputs, step.now)
        contrast.apply(self.scheduler, self.outputs)  # contrastive search: its forks and pruned candidates
        for req, error in self.speculator.propose(self.scheduler.running_requests):
            self._fail(req.payload, error)
        self._end_step(batch)

    def _check_executor(self) -> None:
        """Raise ``ExecutorFailedError`` where the executor says it can run no more steps (a sharded
        model's rank died while the loop was idle); executors without ``check_alive`` always can."""
        check = getattr(self.executor, "check_alive", None)
        if check is not None:
            check()

    def death_reason(self) -> str:
        return f": {self.dead!r}" if self.dead is not None else ""

    # ------------------------------------------------------------------ one step's parts
    @staticmethod
    def _take_draft_logits(
        batch: ScheduledBatch, logits: torch.Tensor
    ) -> tuple[torch.Tensor, list[VerifyRun]]:
        """Set apart the rows of verify chunks' drafts (``VerifyRun``s, in batch order); the sampling rows
        (one per chunk that ``needs_sample``, in batch order) remain."""
        if not any(chunk.draft_ids for chunk in batch.requests):
            return logits, []
        keep: list[int] = []
        runs: list[VerifyRun] = []
        offset = 0
        for chunk in (c for c in batch.requests if c.needs_sample):
            keep.append(offset)
            k = len(chunk.draft_ids)
            if k:
                runs.append(
                    VerifyRun(chunk.request.payload, chunk.draft_ids, logits[offset + 1 : offset + 1 + k])
                )
            offset += 1 + k
        if keep == list(range(keep[0], keep[0] + len(keep))):  # one stream's verify chunk: a view, no copy
            return logits[keep[0] : keep[0] + len(keep)], runs
        return logits.index_select(0, torch.tensor(keep, dtype=torch.int64, device=logits.device)), runs

    @staticmethod
    def _take_prompt_logits(batch: ScheduledBatch, logits: torch.Tensor) -> torch.Tensor:
        """Hand the rows asked for prompt logprobs to their groups; the sampling rows remain (one per chunk
        that ``needs_sample``, in batch order, and after it the rows of its drafts)."""
        if all(
            chunk.num_logits_rows == chunk.needs_sample + len(chunk.draft_ids) for chunk in batch.requests
        ):
            return logits
        keep: list[int] = []
        offset = 0
        for chunk in batch.requests:
            n = chunk.num_logits_rows
            seq: Sequence = chunk.request.payload
            if chunk.request.wants_prompt_logits:
                seq.group.add_prompt_logits(chunk.request, chunk.start, logits[offset : offset + n])
            if chunk.needs_sample:
                first = offset + n - 1 - len(chunk.draft_ids)  # the sampling row, then the drafts' rows
                keep.extend(range(first, offset + n))
                if seq.group.prompt_logprobs is not None and seq.group.prompt_logprobs.failed:
                    # NOTE: the sampler fails a row with NaN logits: the request fails as for a bad sample.
                    logits[first] = float("nan")
            offset += n
        return logits.index_select(0, torch.tensor(keep, dtype=torch.int64, device=logits.device))

    def _fork(self, parent: Sequence, children: list[tuple[Sequence, SampledToken]], now: float) -> None:
        """Give each sibling its first token and, unless that ended it, its own scheduler request sharing
        the parent's blocks; then finish a parent that ended on the fan-out's step."""
        for child, tok in children:
            reason = self.outputs.accept(child, tok, now)
            if isinstance(reason, FinishReason):
                child.finished = True
                self.outputs.publish(child, finish_reason=reason)
            elif reason is not None:
                self._fail(child, reason.error, reason.code)
            else:
                request = child.group.new_request(child, output_ids=[tok.token_id])
                child.request = self.scheduler.fork(parent.scheduler_id, request)
                self.outputs.publish(child)
        if parent.pending_reason is not None:
            self.scheduler.finish_request(parent.scheduler_id, parent.pending_reason)

    def _end_step(self, batch: ScheduledBatch) -> None:
        self.num_steps += 1
        for fn in self.step_observers:
            fn(batch.num_tokens)
        self._publish_kv_events()
        self._publish_stats()

    def _publish_kv_events(self) -> None:
        """Hand the KV-cache events recorded since the last call to the observers (none: nothing taken)."""
        if not self.kv_event_observers:
            return
        events = self.scheduler.kv_manager.take_events()
        if events:
            for fn in self.kv_event_observers:
                fn(events)

    def _idle(self, timeout: float) -> None:
        self._publish_stats()
        self.inbox.wait(timeout)

    # ------------------------------------------------------------------ the inbox
    def _drain_inbox(self) -> int:
        """Handle every message put so far; returns how many requests it admitted."""
        admitted = 0
        for message in self.inbox.drain():
            admitted += isinstance(message, AddRequest)
            self._handle(message)
        return admitted

    def _gather_arrivals(self, admitted: int) -> None:
        """Requests that reach an idle engine together start together: where nothing runs yet and a drain
        admitted some, the rest of a burst may still be on its way (the server admits one request at a
        time), so wait until none has come for ``arrival_window_s`` (at most ``ARRIVAL_CAP`` windows), or
        until the waiting prompts fill a step. Otherwise the first step prefills the early ones, the late
        ones are prefilled beside the early ones' first decode, and each early request's first interval is
        that whole prefill. A burst's first request usually reaches the engine alone (the others are still
        being parsed), so a lone request waits too, one window: a request that nothing follows starts that
        much later (3 ms by default), where a burst would otherwise prefill one prompt alone and the rest a
        step later. A request that arrives while others run starts at once (docs/BENCHMARKS.md: gathering
        there too did not shorten the tail)."""
        if self.arrival_window_s <= 0 or admitted < 1 or self.scheduler.num_running:
            return
        window = self.arrival_window_s
        quiet_since = time.monotonic()
        deadline = quiet_since + ARRIVAL_CAP * window
        while not self.stopping.is_set() and not self._waiting_fill_a_step():
            now = time.monotonic()
            if now >= deadline or now - quiet_since >= window:
                return
            self._publish_stats()  # NOTE: the admitted ones count against the server's queue limit meanwhile
            # NOTE: a wake-up left from the puts already drained ends this wait early: the window is timed
            self.inbox.wait(min(window - (now - quiet_since), deadline - now))
            if self.inbox.num_adds:
                self._drain_inbox()
                quiet_since = time.monotonic()

    def _waiting_fill_a_step(self) -> bool:
        """Whether the waiting requests' uncomputed tokens fill a step's token budget (later arrivals would
        wait for the next step whatever happens)."""
        pending = sum(r.num_uncomputed_tokens for r in self.scheduler.waiting_requests)
        return pending >= self.scheduler.config.max_batch_tokens

    def _handle(self, message: InboxMessage) -> None:
        if isinstance(message, AddRequest):
            self._admit(message.group)
        elif isinstance(message, CancelRequest):
            self._cancel(message.request_id)
        elif isinstance(message, EvictRequest):
            # the scheduler knows each sample, beam or fork as "{id}#{index}" (pruned ones leave gaps)
            prefix = f"{message.request_id}#"
            for scheduler_id in self.scheduler.recently_finished_ids():
                if scheduler_id.startswith(prefix):
                    self.scheduler.evict_request_from_cache(scheduler_id)
        elif isinstance(message, ResetPrefixCache):
            cleared = self.scheduler.reset_prefix_cache()
            self._publish_kv_events()  # NOTE: before the answer: a caller told "cleared" sees the event sent
            message.done.set_result(cleared)

    def _admit(self, group: SequenceGroup) -> None:
        seq = group.start()
        seq.request = group.new_request(seq)
        self.outputs.add(group)
        try:
            self.scheduler.add_request(seq.request)
        except Exception as exc:
            self._fail(seq, str(exc))

    def _cancel(self, request_id: str) -> None:
        group = self.outputs.groups.get(request_id)
        if group is None:
            return
        for seq in list(group.sequences):
            if seq.finished:
                continue
            if seq.request is not None:
                self.scheduler.finish_request(seq.scheduler_id, FinishReason.ABORT)
            self.outputs.cancel(seq)
        self._end_search(group, FinishReason.ABORT)
        for seq in group.never_started():
            self.outputs.cancel(seq)

    # ------------------------------------------------------------------ failing
    def _fail(self, seq: Sequence, error: str, error_code: str | None = None) -> None:
        """Fail one sequence (and the siblings it has not forked yet; a beam: its whole search)."""
        if seq.finished:
            return
        if seq in seq.group.searching():
            self._end_search(seq.group, FinishReason.ERROR)
            for output in seq.group.never_started():
                self.outputs.fail(output, error, error_code)
            return
        if seq.request is not None and not seq.request.is_finished:
            self.scheduler.finish_request(seq.scheduler_id, FinishReason.ERROR)
        self.outputs.fail(seq, error, error_code)
        for sibling in seq.group.unforked_siblings(seq):
            self.outputs.fail(sibling, error, error_code)

    def _end_search(self, group: SequenceGroup, reason: FinishReason) -> None:
        """Finish a beam search's running beams (they publish nothing of their own)."""
        for beam in group.searching():
            beam.finished = True
            self.scheduler.finish_request(beam.scheduler_id, reason)

    def _fail_step(self, batch: ScheduledBatch, exc: Exception) -> None:
        logger.exception("forward failed; failing the %d requests of this step", len(batch), exc_info=exc)
        for chunk in batch.requests:
            self._fail(chunk.request.payload, f"the model's forward failed: {exc!r}")
        self._publish_stats()

    def _fail_everything(self, error: str) -> None:
        for message in self.inbox.drain():  # requests not admitted yet fail too
            if isinstance(message, AddRequest):
                message.group.start()
                self.outputs.add(message.group)
            elif isinstance(message, ResetPrefixCache):  # its caller waits for an answer
                message.done.set_result(False)
        for group in list(self.outputs.groups.values()):
            for seq in [*group.sequences, *group.searching()]:
                try:
                    self._fail(seq, error)
                except Exception:  # NOTE: the scheduler may be broken too; the client must still hear.
                    self.outputs.fail(seq, error)

    # ------------------------------------------------------------------ stats
    def _snapshot(self, running: bool) -> EngineStats:
        s = self.scheduler
        spec = self.speculator.stats
        return EngineStats(
            num_requests_running=s.num_running,
            num_requests_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage(),
            num_blocks=s.num_blocks,
            block_size=s.block_size,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            num_grammar_matchers=self.outputs.num_grammar_matchers(),
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=tuple(spec.accepted_per_position),
            is_running=running,
        )

    def _publish_stats(self, running: bool = True) -> None:
        self.stats = self._snapshot(running=running and not self.stopping.is_set())
