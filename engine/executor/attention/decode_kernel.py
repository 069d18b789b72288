"""What paged attention asks of a decode-attention kernel (the CPU C kernel of ``cpu_kernel.py``, the GPU
Triton kernel of ``triton_decode.py``): one query per sequence over its KV pages, read in place through
the block table, and the step's new K/V written into their slots. A kernel that is also a
``PrefillKernel`` (the CPU one) runs the prefill part of a batch too."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


class DecodeKernel(Protocol):
    name: str  # the --attention-backend value that picks it
    batch_invariant: bool  # a query's result never depends on what else the call holds

    def unsupported(
        self, head_dim: int, block_size: int, group: int, dtype: torch.dtype, softcap: float | None = None
    ) -> str | None:
        """Why this configuration cannot use the kernel, or None when it can (``softcap``: the model's
        attention logit soft-capping, Gemma 2's)."""
        ...

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store the new tokens' ``k``/``v`` ``[num_tokens, num_kv_heads, head_dim]`` into ``slots``."""
        ...

    def __call__(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query per sequence
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim, block_size]
        v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        block_tables: torch.Tensor,  # [num_seqs, pages of the longest] int64
        seq_lens: torch.Tensor,  # [num_seqs] int64, >= 1
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """``[num_seqs, num_heads, head_dim]`` in q's dtype; with ``softcap`` the scores become
        ``softcap * tanh(score / softcap)`` before the softmax."""
        ...


@runtime_checkable
class PrefillKernel(Protocol):
    def prefill(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the sequences' new queries, one after another
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim, block_size]
        v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        block_tables: torch.Tensor,  # [num_seqs, pages of the longest] int64
        query_starts: torch.Tensor,  # [num_seqs + 1] int64: sequence s's queries are rows starts[s]:starts[s+1]
        seq_lens: torch.Tensor,  # [num_seqs] int64: KV length with the new tokens (already in the cache)
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of each sequence's new queries over its pages: ``[num_tokens, num_heads,
        head_dim]`` in q's dtype."""
        ...
