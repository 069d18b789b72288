"""Paged attention in plain PyTorch (CPU and CUDA): at most two ``scaled_dot_product_attention`` calls per
layer for the whole ragged batch -- one for the decoding sequences, one for the prefill chunks -- and no
Python loop over sequences. The split matters: padding every decode query to the longest prefill chunk of
a mixed batch would multiply the attention work by that chunk's length.

Per layer and part:
1. write the new tokens' K/V into their slots (``slot_mapping``) of the paged cache;
2. gather each sequence's pages with its block table: ``k_cache[block_tables]`` ->
   ``[num_seqs, num_pages * block_size, num_kv_heads, head_dim]``;
3. lay the queries out per sequence (the decode part needs no padding: one query per sequence), with the
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


def _attention_bias(
    query_pos: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_len: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive mask (0 or -inf) ``[num_seqs, q_len, kv_len]``: key ``j`` is visible to a query at position
    ``p`` of a sequence of KV length ``n`` iff ``j <= p`` and ``j < n`` (and within the sliding window)."""
    key_pos = torch.arange(kv_len, device=query_pos.device)  # [kv_len]
    allowed = (key_pos <= query_pos) & (key_pos < seq_lens[:, None, None])  # [num_seqs, q_len, kv_len]
    if sliding_window is not None:
        allowed &= key_pos > query_pos - sliding_window
    bias = torch.zeros(allowed.shape, dtype=dtype, device=query_pos.device)
    return bias.masked_fill_(~allowed, float("-inf"))


# Decode sequences are split into at most this many groups of similar KV length, each gathered and attended
# with its own padding: one group per sequence wastes calls, one for all pads every sequence to the longest.
MAX_DECODE_GROUPS = 4
GROUP_COST_TOKENS = 1024  # a group's fixed cost (three more ops per layer), in padded KV rows


def decode_groups(seq_lens: tuple[int, ...], block_size: int) -> list[tuple[int, int, int]]:
    """Split ascending ``seq_lens`` into ``(start, end, num_pages)`` runs minimising the padded KV rows
    (``(end - start) * num_pages * block_size``) plus ``GROUP_COST_TOKENS`` per group."""
    n = len(seq_lens)
    if n == 0:
        return []
    pages = [-(-length // block_size) for length in seq_lens]
    inf = float("inf")
    # best[g][i]: least cost of the first i sequences in g groups; cut[g][i]: where the last group starts
    best = [[inf] * (n + 1) for _ in range(MAX_DECODE_GROUPS + 1)]
    cut = [[0] * (n + 1) for _ in range(MAX_DECODE_GROUPS + 1)]
    best[0][0] = 0.0
    for g in range(1, MAX_DECODE_GROUPS + 1):
        for i in range(1, n + 1):
            for j in range(i):  # the group is sequences j..i-1; the longest is i-1 (ascending)
                cost = best[g - 1][j] + (i - j) * pages[i - 1] * block_size + GROUP_COST_TOKENS
                if cost < best[g][i]:
                    best[g][i], cut[g][i] = cost, j
    g = min(range(1, MAX_DECODE_GROUPS + 1), key=lambda k: best[k][n])
    groups: list[tuple[int, int, int]] = []
    i = n
    while g:
        j = cut[g][i]
        groups.append((j, i, pages[i - 1]))
        i, g = j, g - 1
    return groups[::-1]


@dataclass(frozen=True)
class DecodePart:
    """A run of decoding sequences (rows ``start:end`` of the batch): one query each, no padding."""

    block_tables: torch.Tensor  # [num_seqs, num_pages] int64
    attn_bias: torch.Tensor  # [num_seqs, 1, 1, kv_len]
    start: int
    end: int

    @property
    def num_seqs(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PrefillPart:
    """The sequences computing several tokens (after the decode part), queries padded to ``q_len``."""

    block_tables: torch.Tensor  # [num_seqs, num_pages] int64
    attn_bias: torch.Tensor  # [num_seqs, 1, group * q_len, kv_len]
    query_index: torch.Tensor  # [num_tokens] row of each of the part's tokens in [num_seqs * q_len]
    num_seqs: int
    q_len: int


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """The per-batch tensors every layer's attention reads. Build with :meth:`build`."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int  # the decode parts' tokens are the batch's first rows
    decode: list[DecodePart]
    prefill: PrefillPart | None
    num_queries_per_kv: int

    @property
    def is_decode(self) -> bool:
        return self.prefill is None

    @classmethod
    def build(
        cls,
        inputs: BatchInputs,
        num_queries_per_kv: int,
        dtype: torch.dtype,
        sliding_window: int | None = None,
    ) -> PagedAttentionMetadata:
        """Everything here uses tensors already on the device and Python ints from ``inputs``: no host sync."""
        block_size = inputs.block_size
        num_decode = inputs.num_decode_seqs
        decode: list[DecodePart] = []
        prefill = None
        for start, end, num_pages in decode_groups(inputs.decode_seq_lens, block_size):
            seq_lens = inputs.seq_lens[start:end]  # [group]
            bias = _attention_bias(
                (seq_lens - 1)[:, None, None], seq_lens, num_pages * block_size, sliding_window, dtype
            )  # [group, 1, kv_len]
            decode.append(DecodePart(inputs.block_tables[start:end, :num_pages], bias[:, None], start, end))
        num_prefill = inputs.num_seqs - num_decode
        if num_prefill:
            q_len = inputs.prefill_max_query_len
            num_pages = -(-inputs.prefill_max_seq_len // block_size)
            device = inputs.input_ids.device
            starts = inputs.query_start_loc[num_decode:]  # [num_prefill + 1]
            first = num_decode  # the prefill part's first token row (decode sequences hold one each)
            tokens = torch.arange(inputs.num_tokens - first, device=device) + first  # [num_prefill_tokens]
            seq_of_token = torch.searchsorted(starts[1:], tokens, right=True)  # [num_prefill_tokens]
            row_in_seq = tokens - starts[seq_of_token]  # [num_prefill_tokens]
            query_index = seq_of_token * q_len + row_in_seq  # [num_prefill_tokens]
            # Padding rows get position 0: they attend to key 0 only, so no row is fully masked (NaN-free);
            # their outputs are dropped.
            query_pos = torch.zeros(num_prefill * q_len, dtype=torch.int64, device=device)
            query_pos = query_pos.index_copy(0, query_index, inputs.positions[first:]).view(
                num_prefill, q_len, 1
            )
            bias = _attention_bias(
                query_pos, inputs.seq_lens[num_decode:], num_pages * block_size, sliding_window, dtype
            )  # [num_prefill, q_len, kv_len]
            # Fold the GQA group into the query axis: row g * q_len + i is query i of group member g.
            bias = (
                bias[:, None, None]
                .expand(num_prefill, 1, num_queries_per_kv, q_len, bias.shape[-1])
                .reshape(num_prefill, 1, num_queries_per_kv * q_len, bias.shape[-1])
            )  # [num_prefill, 1, group * q_len, kv_len]
            prefill = PrefillPart(
                inputs.block_tables[num_decode:, :num_pages], bias, query_index, num_prefill, q_len
            )
        return cls(inputs.slot_mapping, num_decode, decode, prefill, num_queries_per_kv)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store the new tokens' keys/values ``[num_tokens, num_kv_heads, head_dim]`` into their slots."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(
        0, slot_mapping, k
    )  # [num_slots, kv_heads, head_dim]
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather_pages(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    num_seqs, num_pages = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    # NOTE: index_select copies whole blocks (memcpy speed); advanced indexing ``cache[block_tables]`` is ~5x
    # slower on CPU. The transposed view goes to SDPA as is: a .contiguous() copy costs more than it saves.
    pages = cache.index_select(
        0, block_tables.reshape(-1)
    )  # [num_seqs * num_pages, block_size, kv_heads, hd]
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
    write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
    group = meta.num_queries_per_kv
    parts = [_decode_attention(q[p.start : p.end], k_cache, v_cache, p, group, scale) for p in meta.decode]
    if meta.prefill is not None:
        d = meta.num_decode_tokens
        parts.append(_prefill_attention(q[d:], k_cache, v_cache, meta.prefill, group, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # [num_tokens, num_heads, head_dim]


def _decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, part: DecodePart, group: int, scale: float
) -> torch.Tensor:
    """One query per sequence, so the group of query heads sharing a KV head is the query axis."""
    num_tokens, num_heads, head_dim = q.shape
    keys = _gather_pages(k_cache, part.block_tables)  # [num_seqs, kv_heads, kv_len, head_dim]
    values = _gather_pages(v_cache, part.block_tables)  # [num_seqs, kv_heads, kv_len, head_dim]
    queries = q.view(
        part.num_seqs, num_heads // group, group, head_dim
    )  # [num_seqs, kv_heads, group, head_dim]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=part.attn_bias, scale=scale)
    return out.reshape(num_tokens, num_heads, head_dim)  # [num_tokens, num_heads, head_dim]


def _prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, part: PrefillPart, group: int, scale: float
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = num_heads // group
    num_seqs, q_len = part.num_seqs, part.q_len
    keys = _gather_pages(k_cache, part.block_tables)  # [num_seqs, kv_heads, kv_len, head_dim]
    values = _gather_pages(v_cache, part.block_tables)  # [num_seqs, kv_heads, kv_len, head_dim]
    padded = q.new_zeros(num_seqs * q_len, num_heads, head_dim)
    padded.index_copy_(0, part.query_index, q)  # [num_seqs * q_len, num_heads, head_dim]
    queries = (
        padded.view(num_seqs, q_len, num_kv_heads, group, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(num_seqs, num_kv_heads, group * q_len, head_dim)
    )  # [num_seqs, kv_heads, group * q_len, head_dim]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=part.attn_bias, scale=scale)
    out = (
        out.view(num_seqs, num_kv_heads, group, q_len, head_dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(num_seqs * q_len, num_heads, head_dim)
    )  # [num_seqs * q_len, num_heads, head_dim]
    return out.index_select(0, part.query_index)  # [num_tokens, num_heads, head_dim]
