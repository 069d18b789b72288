"""Paged attention: the new tokens of one ragged batch attend over their sequences' KV pages, in at most a
few calls per layer for the whole batch and no Python loop over sequences.

The batch has two parts (``BatchInputs`` lays the decoding sequences out first):

- **decode** (one new query per sequence): a kernel reads each sequence's pages in place through its
  block table: the C kernel of ``cpu_kernel.py`` on the CPU, the Triton kernel of ``triton_decode.py`` on
  CUDA. Without one (``--attention-backend sdpa``, no compiler, no Triton), the sequences are split into
  at most ``MAX_DECODE_GROUPS`` runs of similar KV length; each run gathers its pages and makes one SDPA
  call with the query heads that share a KV head folded into the query axis (GQA without repeating K/V).
- **prefill** (several new tokens per sequence): where the decode kernel also runs prefill (the CPU one,
  ``PrefillKernel``), every prefilling sequence in one call per layer, its queries over its pages in
  place. Otherwise one SDPA call per sequence, unpadded (a step holds a few prompt chunks; padding them to
  the longest cost twice the work). A fresh prompt attends over its own new K/V, plain causal, nothing
  gathered; a continuation chunk gathers its pages and uses an additive mask that allows key ``j`` for a
  query at position ``p`` iff ``j <= p`` and ``j`` is a real key (and ``j > p - sliding_window`` when the
  model has one).

Soft-capped attention logits (Gemma 2: ``softcap * tanh(score / softcap)`` before the softmax) are computed
by the CPU kernels; SDPA has no such option, so where it would run, the scores are computed in plain
PyTorch instead (``_attend``).

The split matters: padding every decode query to the longest prefill chunk of a mixed batch would multiply
the attention work by that chunk's length. The new tokens' K/V are written into their slots first (by the
kernel's ``write_kv`` where a kernel runs, else by ``index_put_``).

Cache layout (engine/executor/kv_cache.py): K ``[num_blocks, num_kv_heads, head_dim, block_size]``, V
``[num_blocks, num_kv_heads, block_size, head_dim]``. Everything that depends only on the batch (masks,
padding indices, slot coordinates) is computed once per forward in ``PagedAttentionMetadata.build`` and
shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.executor.attention.decode_kernel import DecodeKernel, PrefillKernel
from engine.executor.inputs import BatchInputs


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
    """A run of decoding sequences (rows ``start:end`` of the batch): one query each, no padding. The
    kernel path has one part with every decoding sequence and no mask."""

    block_tables: torch.Tensor  # [num_seqs, num_pages] int64
    seq_lens: torch.Tensor  # [num_seqs] int64
    attn_bias: torch.Tensor | None  # [num_seqs, 1, 1, kv_len]; None on the kernel path
    start: int
    end: int

    @property
    def num_seqs(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PrefillSeq:
    """One sequence computing several new tokens: batch rows ``start:end`` (after the decode part)."""

    start: int
    end: int
    block_tables: torch.Tensor | None  # [1, num_pages] int64 when it has cached context; None: a fresh prompt
    attn_bias: torch.Tensor | None  # [1, 1, q_len, kv_len]; None: causal over the new tokens alone


@dataclass(frozen=True)
class PrefillPart:
    """Every sequence computing several tokens (batch rows ``start:end``), for ``kernel``."""

    kernel: PrefillKernel
    start: int
    end: int
    block_tables: torch.Tensor  # [num_seqs, num_pages] int64
    query_starts: torch.Tensor  # [num_seqs + 1] int64, relative to ``start``
    seq_lens: torch.Tensor  # [num_seqs] int64


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """The per-batch tensors every layer's attention reads. Build with :meth:`build`."""

    slots: torch.Tensor  # [num_tokens] int64, block * block_size + row where each new token's K/V goes
    slot_blocks: torch.Tensor  # [num_tokens] int64, the block each new token's K/V goes to
    slot_offsets: torch.Tensor  # [num_tokens] int64, its row in that block
    decode: list[DecodePart]
    prefill: list[PrefillSeq]
    num_queries_per_kv: int
    sliding_window: int | None = None
    decode_kernel: DecodeKernel | None = None  # the kernel for the decode part, if one was chosen
    # the prefill part for the decode kernel when it runs prefill too (``prefill`` is empty then)
    prefill_part: PrefillPart | None = None

    @property
    def is_decode(self) -> bool:
        return not self.prefill and self.prefill_part is None

    @classmethod
    def build(
        cls,
        inputs: BatchInputs,
        num_queries_per_kv: int,
        dtype: torch.dtype,
        sliding_window: int | None = None,
        decode_kernel: DecodeKernel | None = None,
    ) -> PagedAttentionMetadata:
        """Everything here uses tensors already on the device and Python ints from ``inputs``: no host sync.
        With ``decode_kernel`` the decode part runs in that kernel, unpadded."""
        block_size = inputs.block_size
        decode = _decode_parts(inputs, dtype, sliding_window, decode_kernel is not None)
        prefill_part = (
            _prefill_part(inputs, decode_kernel) if isinstance(decode_kernel, PrefillKernel) else None
        )
        prefill = [] if prefill_part is not None else _prefill_seqs(inputs, dtype, sliding_window)
        slots = inputs.slot_mapping
        return cls(
            slots=slots,
            slot_blocks=slots // block_size,
            slot_offsets=slots % block_size,
            decode=decode,
            prefill=prefill,
            num_queries_per_kv=num_queries_per_kv,
            sliding_window=sliding_window,
            decode_kernel=decode_kernel,
            prefill_part=prefill_part,
        )


def _prefill_part(inputs: BatchInputs, kernel: PrefillKernel) -> PrefillPart | None:
    """The rows, tables and query ranges of every prefilling sequence (after the decoding ones, which hold
    one row each: the first prefilling sequence and its first row have the same index)."""
    if not inputs.prefill_query_lens:
        return None
    first = inputs.num_decode_seqs
    starts = [0]
    for q_len in inputs.prefill_query_lens:
        starts.append(starts[-1] + q_len)
    num_pages = -(-max(inputs.prefill_seq_lens) // inputs.block_size)
    return PrefillPart(
        kernel=kernel,
        start=first,
        end=first + starts[-1],
        block_tables=inputs.block_tables[first:, :num_pages],
        query_starts=torch.tensor(starts, dtype=torch.int64),
        seq_lens=inputs.seq_lens[first:],
    )


def _decode_parts(
    inputs: BatchInputs, dtype: torch.dtype, sliding_window: int | None, kernel: bool
) -> list[DecodePart]:
    """The kernel takes every decoding sequence in one unpadded part; SDPA takes runs of similar length."""
    num_decode, block_size = inputs.num_decode_seqs, inputs.block_size
    if not num_decode:
        return []
    if kernel:
        num_pages = -(-max(inputs.decode_seq_lens) // block_size)
        tables, seq_lens = inputs.block_tables[:num_decode, :num_pages], inputs.seq_lens[:num_decode]
        return [DecodePart(tables, seq_lens, None, 0, num_decode)]
    parts = []
    for start, end, num_pages in decode_groups(inputs.decode_seq_lens, block_size):
        seq_lens = inputs.seq_lens[start:end]  # [group]
        bias = _attention_bias(
            (seq_lens - 1)[:, None, None], seq_lens, num_pages * block_size, sliding_window, dtype
        )  # [group, 1, kv_len]
        tables = inputs.block_tables[start:end, :num_pages]
        parts.append(DecodePart(tables, seq_lens, bias[:, None], start, end))
    return parts


def _prefill_seqs(inputs: BatchInputs, dtype: torch.dtype, sliding_window: int | None) -> list[PrefillSeq]:
    """One entry per sequence computing several tokens; a fresh prompt without a window needs no tensor."""
    seqs = []
    row = inputs.num_decode_seqs  # decoding sequences hold one token each
    lens = zip(inputs.prefill_query_lens, inputs.prefill_seq_lens, strict=True)
    for seq, (q_len, seq_len) in enumerate(lens, start=inputs.num_decode_seqs):
        cached = seq_len - q_len
        tables: torch.Tensor | None = None
        kv_len = q_len
        if cached:
            num_pages = -(-seq_len // inputs.block_size)
            tables, kv_len = inputs.block_tables[seq : seq + 1, :num_pages], num_pages * inputs.block_size
        bias: torch.Tensor | None = None
        if cached or (sliding_window is not None and q_len > sliding_window):
            query_pos = torch.arange(cached, seq_len, device=inputs.input_ids.device)[
                None, :, None
            ]  # [1, q_len, 1]
            bias = _attention_bias(query_pos, inputs.seq_lens[seq : seq + 1], kv_len, sliding_window, dtype)
            bias = bias[:, None]  # [1, 1, q_len, kv_len]
        seqs.append(PrefillSeq(row, row + q_len, tables, bias))
        row += q_len
    return seqs


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store the new tokens' keys/values ``[num_tokens, num_kv_heads, head_dim]`` into row ``slot_offsets``
    of block ``slot_blocks``."""
    # [num_blocks, block_size, kv_heads, head_dim] views of both layouts, indexed by (block, row)
    k_cache.permute(0, 3, 1, 2).index_put_((slot_blocks, slot_offsets), k)
    v_cache.permute(0, 2, 1, 3).index_put_((slot_blocks, slot_offsets), v)


# NOTE: index_select copies whole blocks (memcpy speed); advanced indexing ``cache[block_tables]`` is ~5x
# slower on CPU.
def _gather_keys(k_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """``[num_seqs, kv_heads, num_pages * block_size, head_dim]``: each sequence's keys, in order."""
    num_seqs, num_pages = block_tables.shape
    _, num_kv_heads, head_dim, block_size = k_cache.shape
    pages = k_cache.index_select(0, block_tables.reshape(-1))  # [num_seqs * num_pages, kv_heads, hd, bs]
    pages = pages.view(num_seqs, num_pages, num_kv_heads, head_dim, block_size).permute(0, 2, 1, 4, 3)
    return pages.reshape(num_seqs, num_kv_heads, num_pages * block_size, head_dim)


def _gather_values(v_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """``[num_seqs, kv_heads, num_pages * block_size, head_dim]``: each sequence's values, in order."""
    num_seqs, num_pages = block_tables.shape
    _, num_kv_heads, block_size, head_dim = v_cache.shape
    pages = v_cache.index_select(0, block_tables.reshape(-1))  # [num_seqs * num_pages, kv_heads, bs, hd]
    pages = pages.view(num_seqs, num_pages, num_kv_heads, block_size, head_dim).transpose(1, 2)
    return pages.reshape(num_seqs, num_kv_heads, num_pages * block_size, head_dim)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the batch's new tokens over their sequences' pages.

    ``q``: ``[num_tokens, num_heads, head_dim]``; ``k``, ``v``: ``[num_tokens, num_kv_heads, head_dim]`` (the
    new tokens, written into the cache first); caches in the layout of engine/executor/kv_cache.py.
    ``softcap``: the scores become ``softcap * tanh(scale * q.k / softcap)`` before the softmax.
    Returns ``[num_tokens, num_heads, head_dim]``.
    """
    group = meta.num_queries_per_kv
    kernel, window = meta.decode_kernel, meta.sliding_window
    if kernel is not None:
        kernel.write_kv(k_cache, v_cache, meta.slots, k, v)
    else:
        write_kv(k_cache, v_cache, meta.slot_blocks, meta.slot_offsets, k, v)
    parts = [
        kernel(q[p.start : p.end], k_cache, v_cache, p.block_tables, p.seq_lens, scale, window, softcap)
        if kernel is not None
        else _decode_attention(q[p.start : p.end], k_cache, v_cache, p, group, scale, softcap)
        for p in meta.decode
    ]
    if meta.prefill_part is not None:
        part = meta.prefill_part
        queries = q[part.start : part.end]
        args = (part.block_tables, part.query_starts, part.seq_lens, scale, window, softcap)
        parts.append(part.kernel.prefill(queries, k_cache, v_cache, *args))
    for p in meta.prefill:
        rows = slice(p.start, p.end)
        parts.append(_prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, p, scale, softcap))
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # [num_tokens, num_heads, head_dim]


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    part: DecodePart,
    group: int,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per sequence, so the group of query heads sharing a KV head is the query axis."""
    num_tokens, num_heads, head_dim = q.shape
    keys = _gather_keys(k_cache, part.block_tables)  # [num_seqs, kv_heads, kv_len, head_dim]
    values = _gather_values(v_cache, part.block_tables)  # [num_seqs, kv_heads, kv_len, head_dim]
    queries = q.view(
        part.num_seqs, num_heads // group, group, head_dim
    )  # [num_seqs, kv_heads, group, head_dim]
    out = _attend(queries, keys, values, part.attn_bias, scale, softcap)
    return out.reshape(num_tokens, num_heads, head_dim)  # [num_tokens, num_heads, head_dim]


def _prefill_attention(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k: torch.Tensor,  # [q_len, num_kv_heads, head_dim], the new tokens' keys
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: PrefillSeq,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """One sequence's chunk; the query heads sharing a KV head use it as is (``enable_gqa``)."""
    queries = q.transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
    if seq.block_tables is None:  # a fresh prompt: its keys are exactly the new tokens'
        keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, kv_heads, q_len, head_dim]
    else:
        keys = _gather_keys(k_cache, seq.block_tables)  # [1, kv_heads, kv_len, head_dim]
        values = _gather_values(v_cache, seq.block_tables)
    if softcap is not None:
        group = queries.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        out = _attend(queries, keys, values, seq.attn_bias, scale, softcap)  # [1, num_heads, q_len, head_dim]
        return out[0].transpose(0, 1)  # [q_len, num_heads, head_dim]
    out = F.scaled_dot_product_attention(
        queries,
        keys,
        values,
        attn_mask=seq.attn_bias,
        is_causal=seq.attn_bias is None,
        scale=scale,
        enable_gqa=True,
    )  # [1, num_heads, q_len, head_dim]
    return out[0].transpose(0, 1)  # [q_len, num_heads, head_dim]


def _attend(
    queries: torch.Tensor,  # [..., q_len, head_dim]
    keys: torch.Tensor,  # [..., kv_len, head_dim]
    values: torch.Tensor,  # [..., kv_len, head_dim]
    bias: torch.Tensor | None,  # additive [..., q_len, kv_len]; None: causal over q_len == kv_len
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """SDPA, or where the scores are soft-capped (which SDPA cannot do) the same in plain PyTorch:
    ``softmax(softcap * tanh(scale * q k^T / softcap) + bias) v`` in float32."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=bias, is_causal=bias is None, scale=scale
        )
    scores = torch.matmul(queries.float(), keys.float().transpose(-1, -2)) * scale  # [..., q_len, kv_len]
    scores = torch.tanh(scores / softcap) * softcap
    if bias is None:
        q_len, kv_len = scores.shape[-2:]
        bias = torch.ones(q_len, kv_len, dtype=torch.bool, device=scores.device).tril_(kv_len - q_len)
        bias = torch.zeros(q_len, kv_len, device=scores.device).masked_fill_(~bias, float("-inf"))
    probs = torch.softmax(scores + bias.float(), dim=-1)  # [..., q_len, kv_len]
    return torch.matmul(probs, values.float()).to(queries.dtype)  # [..., q_len, head_dim]
