"""One request's state as the scheduler sees it.

The scheduling model (as in vLLM v1): there is no prefill or decode phase, only ``num_computed_tokens``
catching up with ``num_tokens`` (prompt + generated) under one token budget. A request whose computed
tokens equal its known tokens needs one new token sampled; anything behind is (chunked) prefill.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no blocks (new, or preempted and waiting to recompute)
    PREFILLING = "prefilling"  # admitted; some known tokens not yet computed
    DECODING = "decoding"  # admitted; every known token computed, one new token per step
    FINISHED = "finished"  # left the scheduler; holds no blocks


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_new_tokens or the model's context
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # failed while being processed


@dataclass(eq=False)
class Request:
    """A sequence to generate. Its block table is the KV-cache manager's (``Scheduler.block_ids``, and
    ``ScheduledRequest.block_ids`` in a batch). ``payload`` is owned by the engine (sampling state,
    detokenizer, ...) and never read by the scheduler."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at (last) admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # NOTE: the engine clears it once every prompt position's logits have been seen: a request recomputed
    # after preemption does not ask again.
    wants_prompt_logits: bool = False  # every prompt position's logits (prompt logprobs), not only the last
    # layers whose hidden states also give logits for the rows this request samples from (DoLa's candidates)
    exit_layers: tuple[int, ...] = ()
    # contrastive search: the final norm's output of the row it samples from, and, until the engine has seen
    # them all (it clears the flag then, as for prompt logits), of every prompt position
    wants_hidden: bool = False
    wants_prompt_hidden: bool = False
    # speculative decoding: tokens proposed to follow the known ones, verified (and accepted or rolled back)
    # in the next step that schedules them; never part of ``all_token_ids``
    draft_ids: list[int] = field(default_factory=list)
    # requests preempted together (a beam search's beams, which all need their logits in the same step)
    gang: str | None = None
    payload: Any = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (a step's chunk of a long context)."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
