"""What a request must satisfy to be admitted: a valid prompt, and a prompt plus ``max_new_tokens`` that
fit the model's context window and the KV cache.

The fit is checked here once, for the server (``server/generation_params.py``) and the manager, before
the request reaches the engine thread; the cache part is ``scheduler.capacity``'s, which the scheduler
itself also applies for direct users.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.generation.config import DEFAULT_MAX_NEW_TOKENS
from scheduler.capacity import check_fits_cache


def check_context_length(prompt_len: int, max_new_tokens: int, max_model_len: int) -> None:
    """Raise ``ContextLengthExceededError`` (HTTP 400) unless the prompt and its new tokens fit the window."""
    # NOTE: at least one new token: a prompt that fills the whole window leaves nothing to generate.
    if prompt_len + max(max_new_tokens, 1) > max_model_len:
        raise ContextLengthExceededError(prompt_len, max_new_tokens, max_model_len)


@dataclass(frozen=True)
class RequestLimits:
    """The longest request the engine can ever run: its context window and its KV cache."""

    max_model_len: int
    block_size: int
    num_blocks: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")

    def default_max_new_tokens(self, prompt_len: int) -> int:
        """The library's default length: ``DEFAULT_MAX_NEW_TOKENS``, capped by the room in the window."""
        return min(DEFAULT_MAX_NEW_TOKENS, max(self.max_model_len - prompt_len, 0))

    def check_fits(self, prompt_len: int, max_new_tokens: int, request_id: str) -> None:
        """Raise ``ContextLengthExceededError`` when the request overflows the context window, and
        ``RequestTooLargeError`` when it needs more KV blocks than the whole cache holds (it would wait
        forever)."""
        check_context_length(prompt_len, max_new_tokens, self.max_model_len)
        check_fits_cache(request_id, prompt_len, max_new_tokens, self.block_size, self.num_blocks)


def check_prompt(prompt_ids: list[int], vocab_size: int) -> None:
    """Raise ``InvalidRequestError`` for an empty prompt or a token id outside the vocabulary."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty: at least one token is needed", param="prompt")
    bad = [t for t in prompt_ids if not isinstance(t, int) or t < 0 or t >= vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})", param="prompt"
        )
