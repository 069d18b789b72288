"""What the engine publishes for a request: one ``GenerationOutput`` per step it produced tokens in
(streaming) or once at the end."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler.request import FinishReason


class RequestStatus(str, enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability after the processors, and the top-N alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 + how many tokens were more likely (prompt logprobs report it)


@dataclass
class GenerationOutput:
    request_id: str
    prompt_ids: list[int]
    generated_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.RUNNING
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: str | None = None  # set when the request's own options caused the failure (a client error)
    index: int = 0  # which of the request's num_return_sequences samples
    text: str = ""  # detokenized text so far (ends before a matched stop string)
    delta_text: str = ""  # text new since the previous output of this request
    delta_ids: list[int] = field(default_factory=list)  # token ids new since the previous output
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when asked
    delta_logprobs: list[TokenLogprob] | None = None
    timestamps: list[float] | None = None  # monotonic time of each generated token, when asked
    # one per prompt token (None for the first), once every prompt position is computed, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # beam search: the hypothesis' score, sum of log-probabilities / length ** length_penalty
    # (transformers' ``sequences_scores``)
    sequence_score: float | None = None
    # monotonic timestamps for metrics
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def is_finished(self) -> bool:
        return self.status is not RequestStatus.RUNNING
