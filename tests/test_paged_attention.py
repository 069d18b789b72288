"""Paged attention against a dense causal reference: random K/V contexts written into random non-contiguous
blocks, mixed prefill / decode / chunk-continuation batches, GQA, sliding window."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.paged import PagedAttentionMetadata, decode_groups, paged_attention
from engine.inputs import BatchInputs, decode_first_order


def dense_reference(
    q: torch.Tensor,  # [q_len, heads, head_dim], the last q_len tokens of the sequence
    k: torch.Tensor,  # [kv_len, kv_heads, head_dim], the whole sequence
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v, one sequence, in float64."""
    q_len, heads, _ = q.shape
    kv_len, kv_heads, _ = k.shape
    group = heads // kv_heads
    k = k.double().repeat_interleave(group, dim=1)  # [kv_len, heads, head_dim]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [heads, q_len, kv_len]
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]  # [q_len, 1]
    k_pos = torch.arange(kv_len)[None, :]  # [1, kv_len]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # [q_len, heads, head_dim]


def run_case(
    seqs: list[tuple[int, int]],  # (cached context length, new tokens) per sequence
    heads: int,
    kv_heads: int,
    head_dim: int = 16,
    block_size: int = 4,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = "cpu",
    tol: float | None = None,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 5
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)  # non-contiguous, interleaved block tables
    tables, full_k, full_v, new_q = [], [], [], []
    for ctx, new in seqs:
        table = [free.pop() for _ in range(-(-(ctx + new) // block_size))]
        tables.append(table)
        k = torch.randn(ctx + new, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx + new, kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(ctx):  # the cached context, as earlier steps would have written it
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        full_k.append(k)
        full_v.append(v)
        new_q.append(torch.randn(new, heads, head_dim, generator=gen).to(dtype))
    inputs = BatchInputs.build(
        [[0] * new for _, new in seqs],
        [ctx for ctx, _ in seqs],
        tables,
        [True] * len(seqs),
        block_size,
        device,
    )
    meta = PagedAttentionMetadata.build(inputs, heads // kv_heads, dtype, sliding_window)
    scale = head_dim**-0.5
    # The flat batch lays the decoding sequences out first; build the new tokens' q/k/v in that order.
    order = decode_first_order([[0] * new for _, new in seqs], [ctx for ctx, _ in seqs])
    seqs = [seqs[i] for i in order]
    tables = [tables[i] for i in order]
    full_k, full_v, new_q = ([x[i] for i in order] for x in (full_k, full_v, new_q))
    k_dev, v_dev = k_cache.to(device), v_cache.to(device)
    out = paged_attention(
        torch.cat(new_q).to(device),
        torch.cat([k[ctx:] for k, (ctx, _) in zip(full_k, seqs, strict=True)]).to(device),
        torch.cat([v[ctx:] for v, (ctx, _) in zip(full_v, seqs, strict=True)]).to(device),
        k_dev,
        v_dev,
        meta,
        scale,
    ).cpu()  # [num_tokens, heads, head_dim]
    k_cache, v_cache = k_dev.cpu(), v_dev.cpu()
    assert out.shape == (inputs.num_tokens, heads, head_dim)
    assert out.dtype == dtype
    if tol is None:
        tol = 1e-5 if dtype == torch.float32 else 3e-2
    row = 0
    for i, (ctx, new) in enumerate(seqs):
        ref = dense_reference(new_q[i], full_k[i], full_v[i], scale, sliding_window)
        torch.testing.assert_close(out[row : row + new].double(), ref, atol=tol, rtol=tol)
        row += new
        # The new tokens' K/V landed in their slots.
        for p in range(ctx, ctx + new):
            blk, off = tables[i][p // block_size], p % block_size
            assert torch.equal(k_cache[blk, off], full_k[i][p])
            assert torch.equal(v_cache[blk, off], full_v[i][p])


MIXED = [(0, 9), (13, 1), (5, 6), (0, 1), (22, 1), (7, 3)]  # fresh prefill, decode, chunk continuation


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (9, 3)])
def test_mixed_prefill_and_decode_batch(heads: int, kv_heads: int) -> None:
    run_case(MIXED, heads, kv_heads)


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(seed: int) -> None:
    rng = random.Random(seed)
    seqs = [(rng.randint(0, 40), rng.choice([1, 1, rng.randint(1, 20)])) for _ in range(rng.randint(1, 7))]
    run_case(seqs, heads=6, kv_heads=rng.choice([1, 2, 3, 6]), block_size=rng.choice([1, 4, 16]), seed=seed)


def test_decode_only_batch_takes_the_unpadded_path() -> None:
    seqs = [(c, 1) for c in (0, 3, 16, 31, 8)]
    inputs = BatchInputs.build([[0]] * 5, [c for c, _ in seqs], [[0, 1, 2, 3, 4, 5, 6, 7]] * 5, [True] * 5, 4)
    assert PagedAttentionMetadata.build(inputs, 2, torch.float32).is_decode
    run_case(seqs, heads=4, kv_heads=2)


def test_single_long_prefill_with_many_blocks() -> None:
    run_case([(0, 70)], heads=4, kv_heads=1, block_size=8)


@pytest.mark.parametrize("window", [1, 5, 12])
def test_sliding_window(window: int) -> None:
    run_case(MIXED, heads=4, kv_heads=2, sliding_window=window)


def test_bfloat16() -> None:
    run_case(MIXED, heads=4, kv_heads=2, dtype=torch.bfloat16)


def test_block_table_columns_beyond_the_longest_sequence_are_ignored() -> None:
    """Runners may pad block tables wider than needed; the metadata trims them to the pages in use."""
    inputs = BatchInputs.build([[1, 2, 3]], [0], [[5, 9, 9, 9]], [True], 4)
    meta = PagedAttentionMetadata.build(inputs, 1, torch.float32)
    assert meta.prefill is not None and meta.decode == []
    assert meta.prefill.block_tables.tolist() == [[5]]
    assert meta.prefill.attn_bias.shape == (1, 1, 3, 4)


def test_mixed_batch_pads_only_the_prefill_part() -> None:
    """Decode sequences go first and unpadded; the prefill part is padded to its own longest chunk."""
    inputs = BatchInputs.build(
        [[1], [1, 2, 3], [4], [5, 6]], [7, 0, 2, 4], [[0, 1], [2], [3], [4, 5]], [True] * 4, 4
    )
    assert inputs.num_decode_seqs == 2
    assert inputs.input_ids.tolist() == [4, 1, 1, 2, 3, 5, 6]  # decode tokens first, shortest KV first
    assert inputs.logits_indices.tolist() == [1, 4, 0, 6]  # logits rows keep the caller's order
    meta = PagedAttentionMetadata.build(inputs, 2, torch.float32)
    assert len(meta.decode) == 1 and meta.decode[0].attn_bias.shape == (2, 1, 1, 8)
    assert meta.prefill is not None and meta.prefill.attn_bias.shape == (2, 1, 2 * 3, 8)


def test_decode_groups_cut_padding_between_short_and_long_sequences() -> None:
    assert decode_groups((1, 2, 3), 16) == [(0, 3, 1)]  # similar lengths: one group
    lens = tuple([10] * 16 + [2000] * 16)
    assert decode_groups(lens, 16) == [(0, 16, 1), (16, 32, 125)]
    assert decode_groups((), 16) == []


def test_many_decode_lengths_match_the_reference() -> None:
    rng = random.Random(7)
    run_case([(rng.choice([0, 3, 40, 90]), 1) for _ in range(12)] + [(5, 9)], heads=4, kv_heads=2)
