"""Paged attention against a dense causal reference: random K/V contexts written into random non-contiguous
blocks, mixed prefill / decode / chunk-continuation batches, GQA, sliding window, soft-capped scores -- in
SDPA (soft-capped: its PyTorch stand-in) and in the CPU kernels (engine/executor/attention/csrc/paged_decode.c for decode, paged_prefill.c for prefill)."""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Iterator

import pytest
import torch
from model_harness import cpu_kernel_or_skip

from engine.executor.attention.cpu_kernel import PagedDecodeKernel
from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.attention.paged import PagedAttentionMetadata, decode_groups, paged_attention
from engine.executor.inputs import BatchInputs, decode_first_order


def dense_reference(
    q: torch.Tensor,  # [q_len, heads, head_dim], the last q_len tokens of the sequence
    k: torch.Tensor,  # [kv_len, kv_heads, head_dim], the whole sequence
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v, one sequence, in float64 (the scores soft-capped:
    ``softcap * tanh(s / softcap)``, where given)."""
    q_len, heads, _ = q.shape
    kv_len, kv_heads, _ = k.shape
    group = heads // kv_heads
    k = k.double().repeat_interleave(group, dim=1)  # [kv_len, heads, head_dim]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [heads, q_len, kv_len]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
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
    kernel: DecodeKernel | None = None,
    stale: float = 0.0,
    softcap: float | None = None,
) -> None:
    """``kernel``: run the decode part in that kernel (CPU C or GPU Triton); ``stale``: what the unused cache slots hold."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 5
    k_cache = torch.full((num_blocks, kv_heads, head_dim, block_size), stale, dtype=dtype)
    v_cache = torch.full((num_blocks, kv_heads, block_size, head_dim), stale, dtype=dtype)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)  # non-contiguous, interleaved block tables
    tables, full_k, full_v, new_q = [], [], [], []
    for ctx, new in seqs:
        table = [free.pop() for _ in range(-(-(ctx + new) // block_size))]
        tables.append(table)
        k = torch.randn(ctx + new, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx + new, kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(ctx):  # the cached context, as earlier steps would have written it
            k_cache[table[p // block_size], :, :, p % block_size] = k[p]
            v_cache[table[p // block_size], :, p % block_size] = v[p]
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
    meta = PagedAttentionMetadata.build(inputs, heads // kv_heads, dtype, sliding_window, kernel)
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
        softcap,
    ).cpu()  # [num_tokens, heads, head_dim]
    k_cache, v_cache = k_dev.cpu(), v_dev.cpu()
    assert out.shape == (inputs.num_tokens, heads, head_dim)
    assert out.dtype == dtype
    if tol is None:
        tol = 1e-5 if dtype == torch.float32 else 3e-2
    row = 0
    for i, (ctx, new) in enumerate(seqs):
        ref = dense_reference(new_q[i], full_k[i], full_v[i], scale, sliding_window, softcap)
        torch.testing.assert_close(out[row : row + new].double(), ref, atol=tol, rtol=tol)
        row += new
        # The new tokens' K/V landed in their slots.
        for p in range(ctx, ctx + new):
            blk, off = tables[i][p // block_size], p % block_size
            assert torch.equal(k_cache[blk, :, :, off], full_k[i][p])
            assert torch.equal(v_cache[blk, :, off], full_v[i][p])


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


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [0.7, 3.0])
def test_soft_capped_scores(softcap: float, window: int | None) -> None:
    """Gemma 2's ``softcap * tanh(score / softcap)``: SDPA cannot, so that path computes it in PyTorch,
    for fresh prompts (causal), continuation chunks and decode groups (masked), with GQA."""
    run_case(MIXED + [(0, 20)], heads=8, kv_heads=2, sliding_window=window, softcap=softcap)


def test_bfloat16() -> None:
    run_case(MIXED, heads=4, kv_heads=2, dtype=torch.bfloat16)


def test_block_table_columns_beyond_the_longest_sequence_are_ignored() -> None:
    """Runners may pad block tables wider than needed; the metadata trims them to the pages in use."""
    inputs = BatchInputs.build([[1, 2, 3]], [2], [[5, 7, 9, 9]], [True], 4)
    meta = PagedAttentionMetadata.build(inputs, 1, torch.float32)
    assert meta.decode == [] and len(meta.prefill) == 1
    seq = meta.prefill[0]
    assert seq.block_tables is not None and seq.block_tables.tolist() == [[5, 7]]
    assert seq.attn_bias is not None and seq.attn_bias.shape == (1, 1, 3, 8)


def test_mixed_batch_pads_nothing() -> None:
    """Decode sequences go first and unpadded; each prefill chunk is attended on its own: a fresh prompt
    over its new keys alone (nothing gathered, plain causal), a continuation over its pages with a mask."""
    inputs = BatchInputs.build(
        [[1], [1, 2, 3], [4], [5, 6]], [7, 0, 2, 4], [[0, 1], [2], [3], [4, 5]], [True] * 4, 4
    )
    assert inputs.num_decode_seqs == 2
    assert inputs.input_ids.tolist() == [4, 1, 1, 2, 3, 5, 6]  # decode tokens first, shortest KV first
    assert inputs.logits_indices.tolist() == [1, 4, 0, 6]  # logits rows keep the caller's order
    meta = PagedAttentionMetadata.build(inputs, 2, torch.float32)
    assert len(meta.decode) == 1 and meta.decode[0].attn_bias is not None
    assert meta.decode[0].attn_bias.shape == (2, 1, 1, 8)
    fresh, continued = meta.prefill
    assert (fresh.start, fresh.end, fresh.block_tables, fresh.attn_bias) == (2, 5, None, None)
    assert (continued.start, continued.end) == (5, 7)
    assert continued.block_tables is not None and continued.block_tables.tolist() == [[4, 5]]
    assert continued.attn_bias is not None and continued.attn_bias.shape == (1, 1, 2, 8)


def test_decode_groups_cut_padding_between_short_and_long_sequences() -> None:
    assert decode_groups((1, 2, 3), 16) == [(0, 3, 1)]  # similar lengths: one group
    lens = tuple([10] * 16 + [2000] * 16)
    assert decode_groups(lens, 16) == [(0, 16, 1), (16, 32, 125)]
    assert decode_groups((), 16) == []


def test_many_decode_lengths_match_the_reference() -> None:
    rng = random.Random(7)
    run_case([(rng.choice([0, 3, 40, 90]), 1) for _ in range(12)] + [(5, 9)], heads=4, kv_heads=2)


# ---------------------------------------------------------------------- the CPU decode kernel
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3), (32, 8), (28, 4), (16, 2)])
@pytest.mark.parametrize("head_dim", [16, 48, 64, 80, 128])
def test_cpu_kernel_matches_the_reference(heads: int, kv_heads: int, head_dim: int) -> None:
    """GQA groups of 1 to 8 (Qwen2.5-7B's 28/4 takes the generic loop); head_dim 64 and 128 with groups
    1, 2, 3, 4 and 8 have their own unrolled loops. On CPUs without AVX-512 the value pass runs over
    slices of head_dim (48 and 80: slices that are not powers of two of the vector width)."""
    rng = random.Random(heads * head_dim)
    seqs = [(rng.choice([0, 5, 15, 16, 17, 40, 100]), 1) for _ in range(10)] + [(3, 9), (0, 20)]
    run_case(seqs, heads, kv_heads, head_dim=head_dim, block_size=16, kernel=cpu_kernel_or_skip())


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_sliding_window_and_bfloat16(window: int, dtype: torch.dtype) -> None:
    seqs = [(c, 1) for c in (0, 4, 15, 16, 31, 32, 33, 63, 70)] + [(2, 5)]
    run_case(
        seqs,
        8,
        2,
        head_dim=64,
        block_size=16,
        sliding_window=window,
        dtype=dtype,
        kernel=cpu_kernel_or_skip(),
    )


@pytest.mark.parametrize("block_size", [32, 64])
def test_cpu_kernel_larger_blocks(block_size: int) -> None:
    run_case(
        [(c, 1) for c in (0, 31, 32, 64, 130)],
        6,
        2,
        head_dim=64,
        block_size=block_size,
        kernel=cpu_kernel_or_skip(),
    )


def test_cpu_kernel_never_reads_slots_beyond_the_sequence() -> None:
    """Unused slots may hold anything a freed block left there (even NaN): the kernel computes scores for
    whole 16-key tiles but reads only the visible ones."""
    seqs = [(c, 1) for c in (0, 1, 14, 16, 20, 47)]
    run_case(seqs, 4, 2, head_dim=64, block_size=16, kernel=cpu_kernel_or_skip(), stale=float("nan"))
    run_case(
        seqs,
        4,
        2,
        head_dim=64,
        block_size=16,
        kernel=cpu_kernel_or_skip(),
        stale=float("nan"),
        sliding_window=7,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_writes_kv_from_strided_views_and_rejects_bad_slots(dtype: torch.dtype) -> None:
    """K and V come as views into the fused QKV projection (token stride > heads * head_dim)."""
    kernel = cpu_kernel_or_skip()
    blocks, kv_heads, head_dim, block_size = 6, 2, 64, 16
    k_cache = torch.zeros(blocks, kv_heads, head_dim, block_size, dtype=dtype)
    v_cache = torch.zeros(blocks, kv_heads, block_size, head_dim, dtype=dtype)
    qkv = torch.randn(5, 3 * kv_heads * head_dim).to(dtype)
    k = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(5, kv_heads, head_dim)
    v = qkv[:, 2 * kv_heads * head_dim :].view(5, kv_heads, head_dim)
    slots = torch.tensor([0, 17, 31, 95, 40])
    kernel.write_kv(k_cache, v_cache, slots, k, v)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[slot // block_size, :, :, slot % block_size], k[i])
        assert torch.equal(v_cache[slot // block_size, :, slot % block_size], v[i])
    assert int((k_cache != 0).sum()) == int((k != 0).sum())  # nothing else written
    before = k_cache.clone()
    with pytest.raises(ValueError, match="outside the cache"):
        kernel.write_kv(k_cache, v_cache, torch.tensor([1, 2, 3, 96, 4]), k, v)
    with pytest.raises(ValueError, match="outside the cache"):
        kernel.write_kv(k_cache, v_cache, torch.tensor([1, -1, 3, 5, 4]), k, v)
    assert torch.equal(k_cache, before)  # a bad slot anywhere: nothing written
    with pytest.raises(ValueError, match="contiguous rows"):
        kernel.write_kv(k_cache, v_cache, slots, k.transpose(1, 2).contiguous().transpose(1, 2), v)
    with pytest.raises(ValueError, match="expected"):
        kernel.write_kv(k_cache, v_cache, slots, k.float() if dtype == torch.bfloat16 else k.double(), v)


def test_cpu_kernel_says_which_shapes_it_cannot_run() -> None:
    kernel = cpu_kernel_or_skip()
    assert kernel.unsupported(64, 16, 3, torch.float32) is None
    assert "block_size 8" in str(kernel.unsupported(64, 8, 3, torch.float32))
    assert "head_dim 72" in str(kernel.unsupported(72, 16, 3, torch.float32))
    assert "float16" in str(kernel.unsupported(64, 16, 3, torch.float16))
    assert "query heads" in str(kernel.unsupported(64, 16, 64, torch.float32))


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_soft_cap_scores(window: int | None, dtype: torch.dtype) -> None:
    """The decode and prefill kernels soft-cap every visible score before the softmax (scores of about
    N(0, 1) against a cap of 0.7: most are bent); unused slots hold NaN and stay unread."""
    seqs = [(c, 1) for c in (0, 15, 16, 33, 70)] + [(0, 40), (21, 18)]
    kernel = cpu_kernel_or_skip()
    run_case(seqs, 8, 2, head_dim=64, block_size=16, sliding_window=window, dtype=dtype, kernel=kernel,
             softcap=0.7, stale=float("nan"))  # fmt: skip


# ---------------------------------------------------------------------- the CPU prefill kernel
PREFILLS = [(0, 70), (0, 16), (0, 17), (5, 1), (40, 33), (16, 16), (3, 50), (90, 7), (0, 1)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (32, 8), (28, 4), (16, 2)])
@pytest.mark.parametrize("head_dim", [16, 48, 64, 128])
def test_cpu_prefill_kernel_matches_the_reference(heads: int, kv_heads: int, head_dim: int) -> None:
    """Fresh prompts and continuation chunks of 1 to 70 tokens (tiles of 16 queries, whole and partial),
    next to decoding sequences; head_dim 48 takes value slices of 16 floats, the others of 32."""
    run_case(
        PREFILLS + [(7, 1), (30, 1)],
        heads,
        kv_heads,
        head_dim=head_dim,
        block_size=16,
        kernel=cpu_kernel_or_skip(),
    )


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_kernel_sliding_window_and_bfloat16(window: int, dtype: torch.dtype) -> None:
    run_case(
        PREFILLS,
        8,
        2,
        head_dim=64,
        block_size=16,
        sliding_window=window,
        dtype=dtype,
        kernel=cpu_kernel_or_skip(),
    )


@pytest.mark.parametrize("block_size", [32, 64])
def test_cpu_prefill_kernel_larger_blocks(block_size: int) -> None:
    run_case(PREFILLS, 6, 2, head_dim=64, block_size=block_size, kernel=cpu_kernel_or_skip())


def test_cpu_prefill_kernel_never_reads_slots_beyond_the_sequence() -> None:
    """A prompt's last page past its length may hold anything (NaN here): no query ever weighs it."""
    run_case(PREFILLS, 4, 2, head_dim=64, block_size=16, kernel=cpu_kernel_or_skip(), stale=float("nan"))
    run_case(
        PREFILLS,
        4,
        2,
        head_dim=64,
        block_size=16,
        kernel=cpu_kernel_or_skip(),
        stale=float("nan"),
        sliding_window=9,
    )


def test_cpu_prefill_kernel_takes_every_prefill_sequence_in_one_part() -> None:
    kernel = cpu_kernel_or_skip()
    inputs = BatchInputs.build(
        [[1], [1, 2, 3], [4], [5, 6]], [7, 0, 2, 4], [[0, 1], [2], [3], [4, 5]], [True] * 4, 4
    )
    meta = PagedAttentionMetadata.build(inputs, 2, torch.float32, None, kernel)
    assert meta.prefill == [] and not meta.is_decode
    part = meta.prefill_part
    assert part is not None and (part.start, part.end) == (2, 7)  # after the two decoding sequences
    assert part.query_starts.tolist() == [0, 3, 5]
    assert part.seq_lens.tolist() == [3, 6]
    assert part.block_tables.shape == (2, 2)  # trimmed to the longest's pages
    assert part.block_tables[0, 0] == 2 and part.block_tables[1].tolist() == [4, 5]


def test_cpu_prefill_kernel_refuses_query_ranges_that_do_not_fit() -> None:
    kernel = cpu_kernel_or_skip()
    k_cache = torch.zeros(4, 2, 64, 16)
    v_cache = torch.zeros(4, 2, 16, 64)
    q = torch.randn(10, 4, 64)
    tables = torch.tensor([[0, 1], [2, 3]])
    ok = kernel.prefill(
        q, k_cache, v_cache, tables, torch.tensor([0, 4, 10]), torch.tensor([20, 6]), 0.125, None
    )
    assert ok.shape == (10, 4, 64)
    with pytest.raises(ValueError, match="does not fit"):  # 6 queries in a sequence of 5 keys
        kernel.prefill(
            q, k_cache, v_cache, tables, torch.tensor([0, 4, 10]), torch.tensor([20, 5]), 0.125, None
        )
    with pytest.raises(ValueError, match="does not fit"):  # 40 keys need 3 pages, the table has 2
        kernel.prefill(
            q, k_cache, v_cache, tables, torch.tensor([0, 4, 10]), torch.tensor([40, 6]), 0.125, None
        )
    with pytest.raises(ValueError, match="cover"):
        kernel.prefill(
            q, k_cache, v_cache, tables, torch.tensor([0, 4, 9]), torch.tensor([20, 6]), 0.125, None
        )


# ------------------- bfloat16 prefills on AMX tiles or AVX512-BF16 dot products (paged_prefill_bf16.c)
@pytest.fixture(params=["tiles", "dots"])
def bf16_kernel(request: pytest.FixtureRequest) -> Iterator[PagedDecodeKernel]:
    """The CPU kernel with its bfloat16 prefills on AMX tiles, then on AVX512-BF16 dot products (each where
    this CPU has it)."""
    kernel = cpu_kernel_or_skip()
    if request.param not in kernel.prefill_kinds:
        pytest.skip(f"no bfloat16 prefill on {request.param} here")
    default, kernel.bf16_prefill = kernel.bf16_prefill, request.param
    try:
        yield kernel
    finally:
        kernel.bf16_prefill = default


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1), (16, 2), (4, 4)])
@pytest.mark.parametrize("head_dim", [32, 48, 64, 96, 128])
def test_cpu_prefill_kernel_bfloat16_queries(
    heads: int, kv_heads: int, head_dim: int, bf16_kernel: PagedDecodeKernel
) -> None:
    """bfloat16 queries over a bfloat16 cache, on AMX tiles and on dot products (head_dim 96 ends in a pass
    of 32 dimensions; 48, not a multiple of 32, goes to the vector path); stale slots hold NaN."""
    kernel = bf16_kernel
    run_case(PREFILLS, heads, kv_heads, head_dim=head_dim, block_size=16, dtype=torch.bfloat16,
             kernel=kernel, stale=float("nan"))  # fmt: skip


@pytest.mark.parametrize("block_size", [16, 32, 48, 64])
@pytest.mark.parametrize("window,softcap", [(None, None), (17, None), (40, 0.7), (None, 0.7)])
def test_cpu_prefill_kernel_bfloat16_windows_caps_and_pages(
    block_size: int, window: int | None, softcap: float | None, bf16_kernel: PagedDecodeKernel
) -> None:
    """Windows that start mid-chunk, soft caps, pages of 16 to 64 keys (48: a 32-key chunk spans two)."""
    run_case(PREFILLS, 8, 2, head_dim=64, block_size=block_size, sliding_window=window, softcap=softcap,
             dtype=torch.bfloat16, kernel=bf16_kernel, stale=float("nan"))  # fmt: skip


def _prefill_in_chunks(
    kernel: DecodeKernel,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    cuts: list[int],
    window: int | None,
) -> torch.Tensor:
    """One sequence's rows prefilled chunk by chunk (chunk i: rows cuts[i]:cuts[i+1], after the ones before),
    next to a second sequence of 20 queries whose tiles share nothing with them."""
    outs = []
    other_q = torch.randn(20, q.shape[1], q.shape[2], generator=torch.Generator().manual_seed(5)).to(q.dtype)
    tables = torch.stack([table, torch.arange(table.shape[0]) + table.shape[0]])
    for lo, hi in itertools.pairwise(cuts):
        starts = torch.tensor([0, hi - lo, hi - lo + 20])
        out = kernel.prefill(torch.cat([q[lo:hi], other_q]), k_cache, v_cache, tables, starts,
                             torch.tensor([hi, 20]), 0.125, window)  # fmt: skip
        outs.append(out[: hi - lo])
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 23])
@pytest.mark.parametrize("kind", ["tiles", "dots", "vectors"])
def test_cpu_prefill_rows_are_the_same_bits_whole_or_in_chunks(window: int | None, kind: str) -> None:
    """A prompt's attention rows are the same bits prefilled whole or in chunks of any cut (other tiles,
    other key ranges, another sequence beside it): on AMX tiles and on dot products (bfloat16 queries), and
    on the vector path (the same values as float32 queries)."""
    kernel = cpu_kernel_or_skip()
    as_float = kind == "vectors"
    if not as_float and kind not in kernel.prefill_kinds:
        pytest.skip(f"no bfloat16 prefill on {kind} here")
    gen = torch.Generator().manual_seed(0)
    block_size, pages, heads, kv_heads, head_dim = 16, 6, 9, 3, 64
    k_cache = torch.randn(2 * pages, kv_heads, head_dim, block_size, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(2 * pages, kv_heads, block_size, head_dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(90, heads, head_dim, generator=gen).to(torch.bfloat16)
    if as_float:
        q = q.float()
    table = torch.arange(pages)
    default, kernel.bf16_prefill = kernel.bf16_prefill, None if as_float else kind
    try:
        whole = _prefill_in_chunks(kernel, q, k_cache, v_cache, table, [0, 90], window)
        for cuts in ([0, 23, 39, 90], [0, 1, 2, 50, 90], [0, 16, 32, 48, 64, 80, 90]):
            assert torch.equal(_prefill_in_chunks(kernel, q, k_cache, v_cache, table, cuts, window), whole)
    finally:
        kernel.bf16_prefill = default


def test_cpu_prefill_kernel_takes_bfloat16_products_where_the_cpu_has_them() -> None:
    kernel = cpu_kernel_or_skip()
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    assert ("tiles" in kernel.prefill_kinds) == ("amx_bf16" in flags and "amx_tile" in flags)
    assert ("dots" in kernel.prefill_kinds) == ("avx512_bf16" in flags)
    assert kernel.bf16_prefill == (kernel.prefill_kinds[0] if kernel.prefill_kinds else None)
