"""Token-level stopping: EOS, stop_token_ids, max_new_tokens and max_time (stop strings are text-level:
``stop_strings.py``).

EOS (the config's, else the model's; none with ``ignore_eos``) and vLLM's ``stop_token_ids`` finish with
``FinishReason.STOP``; ``max_new_tokens`` and HF's ``MaxTimeCriteria`` with ``FinishReason.LENGTH``.
Nothing but length and time stops a sequence before ``min_new_tokens`` tokens are generated.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from engine.generation.config import DEFAULT_MAX_NEW_TOKENS, GenerationConfig
from scheduler.request import FinishReason


class StoppingCriteria:
    def __init__(
        self,
        config: GenerationConfig,
        eos_token_ids: Sequence[int],
        max_new_tokens: int | None = None,
        start_time: float | None = None,
    ) -> None:
        self.config = config
        eos = config.eos_token_ids or tuple(eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = () if config.ignore_eos else tuple(eos)
        self.stop_token_ids = frozenset(self.eos_token_ids) | frozenset(config.stop_token_ids or ())
        if max_new_tokens is None:
            max_new_tokens = config.max_new_tokens_or(DEFAULT_MAX_NEW_TOKENS)
        self.max_new_tokens = max_new_tokens
        self.start_time = time.monotonic() if start_time is None else start_time

    def may_stop(self, num_output_tokens: int) -> bool:
        """Whether the token that made the output ``num_output_tokens`` long may end it (min_new_tokens)."""
        return num_output_tokens > self.config.min_new_tokens

    def is_stop_token(self, token_id: int, num_output_tokens: int) -> bool:
        """``token_id`` (just appended, output now ``num_output_tokens`` long) is an EOS or stop token."""
        return token_id in self.stop_token_ids and self.may_stop(num_output_tokens)

    def length_or_time(self, num_output_tokens: int, now: float) -> FinishReason | None:
        if num_output_tokens >= self.max_new_tokens:
            return FinishReason.LENGTH
        if self.config.max_time is not None and now - self.start_time > self.config.max_time:
            return FinishReason.LENGTH
        return None
