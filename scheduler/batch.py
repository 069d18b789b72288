"""The batch the scheduler hands to the engine for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    """``num_tokens`` tokens of ``request`` starting at position ``start`` are computed this step, their KV
    written through ``block_ids``, the request's block table (the KV-cache manager's list: read only).

    ``draft_ids``: speculative tokens after the request's known ones, the chunk's last ``len(draft_ids)``
    tokens (a verify chunk: the last known token then the drafts, each position's logits checking the next
    draft)."""

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]
    draft_ids: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def needs_sample(self) -> bool:
        """True when this chunk reaches the last known token (and its drafts): its logits give the next
        token."""
        return self.end == self.request.num_tokens + len(self.draft_ids)

    @property
    def num_logits_rows(self) -> int:
        """How many of this chunk's last rows need logits: every row of a chunk of a request that wants
        its prompt's logits (such a chunk never passes the prompt), else the last row when it samples and
        one more per draft (the last known token's row, then each draft's)."""
        if self.request.wants_prompt_logits:
            return self.num_tokens
        return 1 + len(self.draft_ids) if self.needs_sample else 0

    @property
    def num_hidden_rows(self) -> int:
        """How many of this chunk's last rows need their final hidden state: every row of a chunk of a
        request that wants its prompt's, else the row it samples from when its request wants it."""
        if self.request.wants_prompt_hidden:
            return self.num_tokens
        return int(self.needs_sample and self.request.wants_hidden)

    @property
    def token_ids(self) -> list[int]:
        known = self.request.token_ids_between(self.start, self.end)
        return known + list(self.draft_ids) if self.draft_ids else known


@dataclass
class ScheduledBatch:
    requests: list[ScheduledRequest] = field(default_factory=list)
    # (src, dst) block copies the engine performs before this step's forward (copy-on-write forks).
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # ids of requests preempted while building this batch (their blocks are already freed).
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests
