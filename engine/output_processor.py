"""Output processing: what a step's sampled tokens mean for their requests, and publishing it.

``accept_step`` feeds each sampled token to its sequence's ``RequestGenerationState`` (stopping,
detokenizing) and collects what the scheduler must hear (``StepTokens``). ``publish`` builds a sequence's
``GenerationOutput`` and puts it on its group's sink; ``flush`` hands everything published since the last
flush over at once, one wake-up per event loop per step (engine/request_handle.py). Finish observers see
every final output. Engine thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.errors import UnsatisfiableOptionsError
from engine.generation.grammar import GrammarMatcherError
from engine.generation.sampler import SampledToken
from engine.generation.user_processors import PROCESSOR_FAILED, StoppingCriterionError
from engine.outputs import GenerationOutput, RequestStatus
from engine.request_handle import Sink
from engine.sequence_group import Sequence, SequenceGroup
from scheduler.batch import ScheduledBatch
from scheduler.request import FinishReason

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Failure:
    """A sequence whose token could not be accepted; ``code`` is set when its own options caused it."""

    seq: Sequence
    error: str
    code: str | None = None


@dataclass
class StepTokens:
    """What one step's accepted tokens mean: the scheduler's ``update`` arguments, the forks to make after
    it, the sequences to publish, and the sequences that failed."""

    now: float
    # scheduler id -> the tokens accepted: one sampled token, or (speculative decoding) accepted drafts then one
    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, FinishReason] = field(default_factory=dict)  # scheduler id -> why
    forks: list[tuple[Sequence, list[tuple[Sequence, SampledToken]]]] = field(default_factory=list)
    accepted: list[Sequence] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)


class OutputProcessor:
    def __init__(self) -> None:
        self.groups: dict[str, SequenceGroup] = {}  # unfinished groups by request id
        self.finish_observers: list[Callable[[GenerationOutput], None]] = []
        self._unflushed: list[Sink] = []  # sinks put to since the last flush

    def add(self, group: SequenceGroup) -> None:
        self.groups[group.request_id] = group

    def num_grammar_matchers(self) -> int:
        """Grammar matchers the unfinished groups' samples hold (a finished sample drops its own)."""
        return sum(seq.gen.grammar is not None for g in self.groups.values() for seq in g.sequences)

    # ------------------------------------------------------------------ accepting tokens
    def accept_step(self, batch: ScheduledBatch, sampled: list[list[SampledToken]], now: float) -> StepTokens:
        """``sampled``: per chunk that ``needs_sample``, its sequence's token then, at a fan-out, the
        tokens of its siblings."""
        step = StepTokens(now)
        rows = iter(sampled)
        for chunk in batch.requests:
            if not chunk.needs_sample:
                continue
            tokens = next(rows)
            if not tokens:  # a beam: its group scores it (engine/beam_group.py)
                continue
            seq: Sequence = chunk.request.payload
            reason = self.accept(seq, tokens[0], now)
            if isinstance(reason, Failure):
                step.failed.append(reason)
                continue
            step.new_tokens[seq.scheduler_id] = [tokens[0].token_id]
            step.accepted.append(seq)
            if len(tokens) > 1:
                step.forks.append((seq, seq.group.fan_out(tokens)))
            if reason is not None:
                seq.finished = True
                if len(tokens) > 1:  # NOTE: the parent's blocks must outlive this step's forks.
                    seq.pending_reason = reason
                else:
                    step.finished[seq.scheduler_id] = reason
        return step

    def accept(self, seq: Sequence, tok: SampledToken, now: float) -> FinishReason | Failure | None:
        """Feed one token to ``seq``: why it finished (None: it goes on), or why it failed."""
        if tok.error is not None and tok.error_code is not None:  # the request's options or processors
            if tok.error_code == PROCESSOR_FAILED:
                logger.warning("request %s failed: %s", seq.scheduler_id, tok.error)
            return Failure(seq, tok.error, tok.error_code)
        try:
            if tok.error is not None:
                raise RuntimeError(tok.error)
            result = seq.gen.on_token(tok.token_id, tok.logprob, now)
        except UnsatisfiableOptionsError as exc:
            return Failure(seq, str(exc), UnsatisfiableOptionsError.code)
        except GrammarMatcherError as exc:
            # NOTE: the token came from the matcher's own mask: its grammar asks for bytes this vocabulary
            # cannot spell (a character no token sequence writes), which the request's options caused.
            message = f"the structured output cannot be followed with this model's vocabulary: {exc}"
            return Failure(seq, message, UnsatisfiableOptionsError.code)
        except StoppingCriterionError as exc:
            logger.warning("request %s failed: %s", seq.scheduler_id, exc)
            return Failure(seq, str(exc), PROCESSOR_FAILED)
        except Exception as exc:  # NOTE: one request's failure must not take the batch down.
            logger.exception("request %s failed", seq.scheduler_id)
            return Failure(seq, f"{exc!r}")
        seq.pending_text += result.delta_text
        seq.timestamps.append(now)
        return result.finish_reason

    # ------------------------------------------------------------------ publishing
    def fail(self, seq: Sequence, error: str, error_code: str | None = None) -> None:
        seq.finished = True
        self.publish(
            seq,
            status=RequestStatus.FAILED,
            finish_reason=FinishReason.ERROR,
            error=error,
            error_code=error_code,
        )

    def cancel(self, seq: Sequence) -> None:
        seq.finished = True
        self.publish(seq, status=RequestStatus.CANCELLED, finish_reason=FinishReason.ABORT)

    def publish(
        self,
        seq: Sequence,
        status: RequestStatus | None = None,
        finish_reason: FinishReason | None = None,
        error: str | None = None,
        error_code: str | None = None,
    ) -> None:
        """Put ``seq``'s output on its sink: what is new since its last one (a final output always; a
        running one only for streaming groups)."""
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
        out = self._output(seq, status, reason if done else None, error, error_code)
        if done:
            self._on_final(out)
            if group.on_final_output():
                self.groups.pop(group.request_id, None)
        group.sink.put(out)
        self._unflushed.append(group.sink)

    def _output(
        self,
        seq: Sequence,
        status: RequestStatus,
        reason: FinishReason | None,
        error: str | None,
        error_code: str | None,
    ) -> GenerationOutput:
        """``seq``'s output now; marks what it carries as sent."""
        group = seq.group
        req = seq.request
        ids = list(seq.gen.output_ids)
        logprobs = seq.gen.logprobs if group.config.output_logprobs else None
        out = GenerationOutput(
            request_id=group.request_id,
            prompt_ids=group.prompt_ids,
            generated_ids=ids,
            status=status,
            finish_reason=reason,
            error=error,
            error_code=error_code,
            index=seq.index,
            text=seq.gen.text,
            delta_text=seq.pending_text,
            delta_ids=ids[seq.sent_ids :],
            logprobs=list(logprobs) if logprobs is not None else None,
            delta_logprobs=logprobs[seq.sent_logprobs :] if logprobs is not None else None,
            timestamps=list(seq.timestamps) if group.record_timestamps else None,
            prompt_logprobs=group.prompt_logprobs.entries
            if group.prompt_logprobs is not None and group.prompt_logprobs.is_complete
            else None,
            arrival_time=group.arrival_time,
            first_scheduled_time=req.first_scheduled_time if req is not None else None,
            first_token_time=seq.timestamps[0] if seq.timestamps else None,
            finish_time=time.monotonic() if status is not RequestStatus.RUNNING else None,
            num_cached_tokens=req.num_cached_tokens if req is not None else 0,
            num_preemptions=req.num_preemptions if req is not None else 0,
            sequence_score=seq.score,
        )
        seq.sent_ids = len(ids)
        seq.pending_text = ""
        seq.sent_logprobs = len(logprobs) if logprobs is not None else 0
        return out

    def _on_final(self, out: GenerationOutput) -> None:
        for fn in self.finish_observers:
            try:
                fn(out)
            except Exception:  # NOTE: an observer's bug must not take the engine down.
                logger.exception("finish observer failed")

    def flush(self) -> None:
        """Hand over what was published since the last flush: one wake-up per event loop, not one per
        output."""
        sinks, self._unflushed = self._unflushed, []
        for sink in sinks:
            sink.flush()
