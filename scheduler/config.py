"""The scheduler's budgets and switches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Budgets of one step and the size of the KV cache. Keyword-only; validated on construction.

    - ``max_batch_tokens``: tokens computed in one step, all requests together (prefill chunks + decodes).
    - ``max_num_seqs``: requests in one step, and requests admitted (running) at once.
    - ``block_size``: tokens per KV block; ``num_blocks``: blocks in the cache.
    - ``safety_margin``: a new (or preempted) request is admitted only while the free blocks left after its
      allocation stay >= ``safety_margin * num_blocks`` (unless nothing runs), keeping room for the running
      requests to grow and so avoiding preemptions.
    - ``enable_prefix_caching``: reuse the KV blocks of equal prompt prefixes.
    - ``max_model_len``: the longest sequence (prompt + generated) a request may reach, or None for no limit.
    - ``enable_kv_cache_events``: record the prefix cache's changes for KV-aware routers (kvcache/events.py).
    - ``max_mixed_prefill_tokens``: prompt tokens (prefill chunks) in a step that also decodes, or None for
      the whole ``max_batch_tokens``. A step's time grows with its prefill tokens, and every decoding
      request waits for the whole step: a smaller cap bounds their inter-token latency while prompts are
      prefilled beside them, at the price of more steps to prefill them (a later first token).
    """

    max_batch_tokens: int = 2048
    max_num_seqs: int = 64
    block_size: int = 16
    num_blocks: int
    safety_margin: float = 0.2
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    enable_kv_cache_events: bool = False
    max_mixed_prefill_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_blocks", "max_batch_tokens", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.safety_margin, (int, float)) or not 0.0 <= self.safety_margin < 1.0:
            raise ValueError(f"SchedulerConfig.safety_margin must be in [0, 1), got {self.safety_margin!r}")
        for name in ("enable_prefix_caching", "enable_kv_cache_events"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SchedulerConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int)
            or isinstance(self.max_model_len, bool)
            or self.max_model_len < 1
        ):
            raise ValueError(
                f"SchedulerConfig.max_model_len must be a positive int or None, got {self.max_model_len!r}"
            )

        cap = self.max_mixed_prefill_tokens
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(
                f"SchedulerConfig.max_mixed_prefill_tokens must be a positive int or None, got {cap!r}"
            )

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks the safety margin keeps free when admitting a request beside running ones."""
        return int(self.safety_margin * self.num_blocks)
