"""Whether a request can ever fit the KV cache: the one check that the scheduler and the engine's
admission share (a request that cannot would wait, or preempt others, forever)."""

from __future__ import annotations

from kvcache.sizing import blocks_for_tokens
from scheduler.errors import RequestTooLargeError


def check_fits_cache(
    request_id: str, num_prompt_tokens: int, max_new_tokens: int, block_size: int, num_blocks: int
) -> None:
    """Raise ``RequestTooLargeError`` when the prompt plus ``max_new_tokens`` needs more blocks than the
    whole cache holds."""
    total = num_prompt_tokens + max_new_tokens
    needed = blocks_for_tokens(total, block_size)
    if needed > num_blocks:
        raise RequestTooLargeError(
            request_id,
            total,
            needed,
            num_blocks,
            f"{num_prompt_tokens} prompt tokens + {max_new_tokens} new tokens need {needed} KV blocks of "
            f"{block_size} tokens, but the cache holds only {num_blocks} blocks",
        )
