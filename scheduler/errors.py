"""Errors the scheduler raises to the engine."""

from __future__ import annotations

__all__ = ["RequestTooLargeError"]


class RequestTooLargeError(ValueError):
    """A request whose prompt plus ``max_new_tokens`` can never fit: it needs more KV blocks than the whole
    cache holds (or more tokens than ``max_model_len``), so admitting it would wait or preempt forever."""

    def __init__(
        self, request_id: str, num_tokens: int, num_blocks_needed: int, num_blocks: int, reason: str
    ) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.num_blocks_needed = num_blocks_needed
        self.num_blocks = num_blocks
        super().__init__(f"request {request_id!r} can never fit: {reason}")
