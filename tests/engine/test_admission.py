"""The one "does it fit" check: the context window first (HTTP 400 context_length_exceeded), then the KV
cache (RequestTooLargeError), at the exact boundaries."""

from __future__ import annotations

import pytest

from engine.admission import RequestLimits, check_context_length, check_prompt
from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.generation.config import DEFAULT_MAX_NEW_TOKENS
from scheduler.errors import RequestTooLargeError

LIMITS = RequestLimits(max_model_len=100, block_size=16, num_blocks=4)  # the cache holds 64 tokens


def test_context_window_boundary() -> None:
    check_context_length(90, 10, 100)
    with pytest.raises(ContextLengthExceededError, match="requested 101 tokens"):
        check_context_length(90, 11, 100)
    # a prompt filling the window fails even when no new token is asked for (a default left no room)
    with pytest.raises(ContextLengthExceededError, match=r"100 in the prompt, 0 for the completion"):
        check_context_length(100, 0, 100)


def test_cache_boundary_in_blocks() -> None:
    LIMITS.check_fits(60, 4, "r")  # 64 tokens: exactly 4 blocks
    with pytest.raises(
        RequestTooLargeError, match="need 5 KV blocks of 16 tokens, but the cache holds only 4 blocks"
    ) as info:
        LIMITS.check_fits(60, 5, "r")
    assert (info.value.request_id, info.value.num_tokens, info.value.num_blocks_needed) == ("r", 65, 5)


def test_context_is_checked_before_the_cache() -> None:
    with pytest.raises(ContextLengthExceededError):
        LIMITS.check_fits(95, 10, "r")


def test_default_length_is_capped_by_the_window() -> None:
    assert LIMITS.default_max_new_tokens(10) == min(DEFAULT_MAX_NEW_TOKENS, 90)
    assert LIMITS.default_max_new_tokens(120) == 0


@pytest.mark.parametrize("field", ["max_model_len", "block_size", "num_blocks"])
def test_limits_validate(field: str) -> None:
    values = {"max_model_len": 100, "block_size": 16, "num_blocks": 4, field: 0}
    with pytest.raises(ValueError, match=field):
        RequestLimits(**values)


def test_prompt_checks() -> None:
    check_prompt([0, 9], vocab_size=10)
    with pytest.raises(InvalidRequestError, match="empty"):
        check_prompt([], vocab_size=10)
    with pytest.raises(InvalidRequestError, match=r"token id 10 is outside the vocabulary \[0, 10\)"):
        check_prompt([1, 10], vocab_size=10)
