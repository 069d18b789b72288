"""Paged attention in plain PyTorch (CPU and CUDA): one ``scaled_dot_product_attention`` call per layer for
the whole ragged batch, no Python loop over sequences.

Per layer:
1. write the new tokens' K/V into their slots (``slot_mapping``) of the paged cache;
2. gather each sequence's pages with its block table: ``k_cache[block_tables]`` ->
   ``[num_seqs, num_pages * block_size, num_kv_heads, head_dim]``;
3. lay the queries out per sequence (decode-only batches need no padding: one query per sequence), with the
   query heads that share a KV head folded into the query-length axis (GQA without repeating K/V);
4. one SDPA call with an additive mask that allows key ``j`` for a query at position ``p`` of a sequence of KV
   length ``n`` iff ``j <= p`` and ``j < n`` (and ``j > p - sliding_window`` when the model has one).

Everything that depends only on the batch (the mask, the padding indices) is computed once per forward in
``PagedAttentionMetadata.build`` and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.inputs import BatchInputs


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """The per-batch tensors every layer's attention reads. Build with :meth:`build`."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, num_pages] int64, trimmed to the pages the longest sequence uses
    # Additive mask (0 or -inf) in the query dtype, broadcast over KV heads:
    # decode: [num_seqs, 1, 1, kv_len]; otherwise [num_seqs, 1, group * max_query_len, kv_len].
    attn_bias: torch.Tensor
    # Row of each flat token in the padded [num_seqs * max_query_len] layout; None for decode-only batches.
    query_index: torch.Tensor | None
    num_seqs: int
    max_query_len: int
    num_queries_per_kv: int

    @property
    def is_decode(self) -> bool:
        return self.query_index is None

    @classmethod
    def build(
        cls,
        inputs: BatchInputs,
        num_queries_per_kv: int,
        dtype: torch.dtype,
        sliding_window: int | None = None,
    ) -> PagedAttentionMetadata:
        """Everything here uses tensors already on the device and Python ints from ``inputs``: no host sync."""
        num_seqs, q_len, block_size = inputs.num_seqs, inputs.max_query_len, inputs.block_size
        device = inputs.input_ids.device
        num_pages = -(-inputs.max_seq_len // block_size)
        block_tables = inputs.block_tables[:, :num_pages]  # [num_seqs, num_pages]
        kv_len = num_pages * block_size
        key_pos = torch.arange(kv_len, device=device)  # [kv_len]
        seq_lens = inputs.seq_lens[:, None, None]  # [num_seqs, 1, 1]
        is_decode = q_len == 1 and inputs.num_tokens == num_seqs
        if is_decode:
            query_index = None
            query_pos = (inputs.seq_lens - 1)[:, None, None]  # [num_seqs, 1, 1]
        else:
            tokens = torch.arange(inputs.num_tokens, device=device)  # [num_tokens]
            seq_of_token = torch.searchsorted(inputs.query_start_loc[1:], tokens, right=True)  # [num_tokens]
            row_in_seq = tokens - inputs.query_start_loc[seq_of_token]  # [num_tokens]
            query_index = seq_of_token * q_len + row_in_seq  # [num_tokens]
            # Padding rows get position 0: they attend to key 0 only, so no row is fully masked (NaN-free);
            # their outputs are dropped.
            query_pos = torch.zeros(num_seqs * q_len, dtype=torch.int64, device=device)
            query_pos = query_pos.index_copy(0, query_index, inputs.positions).view(num_seqs, q_len, 1)
        allowed = (key_pos <= query_pos) & (key_pos < seq_lens)  # [num_seqs, q_len, kv_len]
        if sliding_window is not None:
            allowed &= key_pos > query_pos - sliding_window
        attn_bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
        attn_bias.masked_fill_(~allowed, float("-inf"))
        if is_decode:
            attn_bias = attn_bias[:, None]  # [num_seqs, 1, 1, kv_len]
        else:
            # Fold the GQA group into the query axis: row g * q_len + i is query i of group member g.
            attn_bias = (
                attn_bias[:, None, None]
                .expand(num_seqs, 1, num_queries_per_kv, q_len, kv_len)
                .reshape(num_seqs, 1, num_queries_per_kv * q_len, kv_len)
            )  # [num_seqs, 1, group * q_len, kv_len]
        return cls(
            slot_mapping=inputs.slot_mapping,
            block_tables=block_tables,
            attn_bias=attn_bias,
            query_index=query_index,
            num_seqs=num_seqs,
            max_query_len=q_len,
            num_queries_per_kv=num_queries_per_kv,
        )


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store the new tokens' keys/values ``[num_tokens, num_kv_heads, head_dim]`` into their slots."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)  # [num_slots, kv_heads, head_dim]
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather_pages(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    num_seqs, num_pages = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    pages = cache[block_tables]  # [num_seqs, num_pages, block_size, kv_heads, head_dim]
    return pages.view(num_seqs, num_pages * block_size, num_kv_heads, head_dim).transpose(1, 2)
    # -> [num_seqs, kv_heads, kv_len, head_dim]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of the batch's new tokens over their sequences' pages.

    ``q``: ``[num_tokens, num_heads, head_dim]``; ``k``, ``v``: ``[num_tokens, num_kv_heads, head_dim]`` (the
    new tokens, written into the cache first); caches ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    Returns ``[num_tokens, num_heads, head_dim]``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = meta.num_queries_per_kv
    num_seqs, q_len = meta.num_seqs, meta.max_query_len
    write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
    keys = _gather_pages(k_cache, meta.block_tables)  # [num_seqs, kv_heads, kv_len, head_dim]
    values = _gather_pages(v_cache, meta.block_tables)  # [num_seqs, kv_heads, kv_len, head_dim]

    if meta.query_index is None:
        # Decode: one query per sequence, so the group of query heads sharing a KV head is the query axis.
        queries = q.view(num_seqs, num_kv_heads, group, head_dim)  # [num_seqs, kv_heads, group, head_dim]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.attn_bias, scale=scale)
        return out.reshape(num_tokens, num_heads, head_dim)  # [num_tokens, num_heads, head_dim]

    padded = q.new_zeros(num_seqs * q_len, num_heads, head_dim)
    padded.index_copy_(0, meta.query_index, q)  # [num_seqs * q_len, num_heads, head_dim]
    queries = (
        padded.view(num_seqs, q_len, num_kv_heads, group, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(num_seqs, num_kv_heads, group * q_len, head_dim)
    )  # [num_seqs, kv_heads, group * q_len, head_dim]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.attn_bias, scale=scale)
    out = (
        out.view(num_seqs, num_kv_heads, group, q_len, head_dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(num_seqs * q_len, num_heads, head_dim)
    )  # [num_seqs * q_len, num_heads, head_dim]
    return out.index_select(0, meta.query_index)  # [num_tokens, num_heads, head_dim]
