"""Verify runs in the CPU decode attention (engine/executor/attention/csrc/paged_decode.c): the rows of a
speculative verify chunk (one sequence's rows at consecutive KV lengths over the same pages, as
engine/executor/runner.py's ``prepare`` lays them out) are attended together, each K/V page read once for
all of them, and every row's output is the SAME BITS as that row attended alone -- float32 and bfloat16
caches, every unrolled copy of the loops (groups 1, 2, 3, 4, 8, head_dim 64 and 128) and the generic ones,
sliding windows, soft caps, runs of 1 to 9 rows beside ordinary decode rows, contexts across page
boundaries. Stale slots hold NaN: a key past a row's end never enters its sums."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from model_harness import cpu_kernel_or_skip

from engine.executor.attention.cpu_kernel import PagedDecodeKernel
from engine.executor.inputs import BatchInputs

BLOCK = 16


@pytest.fixture(scope="module")
def kernel() -> PagedDecodeKernel:
    return cpu_kernel_or_skip()


@pytest.fixture(scope="module", autouse=True)
def _two_threads() -> Iterator[None]:
    """Fewer threads than work items: the calls keep their runs in tiles (on many threads they would split
    them down to a row per tile)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _step(
    runs: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[BatchInputs, torch.Tensor, torch.Tensor]:
    """A decode step as the runner prepares it: sequence i computes ``runs[i]`` rows (1: an ordinary decode
    row; more: a verify chunk, one row per token over the same pages) after a random context, pages
    scattered over the cache; the keys and values of every sequence's positions written, every other slot
    NaN. Returns the inputs (rows in the engine's order: ascending KV length) and the caches."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    contexts = [rng.randrange(0, 90) for _ in runs]
    pages = [-(-(c + n) // BLOCK) for c, n in zip(contexts, runs, strict=True)]
    num_blocks = sum(pages) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    k_cache = torch.full((num_blocks, kv_heads, head_dim, BLOCK), float("nan"), dtype=dtype)
    v_cache = torch.full((num_blocks, kv_heads, BLOCK, head_dim), float("nan"), dtype=dtype)
    token_ids, starts, tables = [], [], []
    for context, n, count in zip(contexts, runs, pages, strict=True):
        table = [free.pop() for _ in range(count)]
        for p in range(context + n):
            k_cache[table[p // BLOCK], :, :, p % BLOCK] = torch.randn(kv_heads, head_dim, generator=gen)
            v_cache[table[p // BLOCK], :, p % BLOCK] = torch.randn(kv_heads, head_dim, generator=gen)
        token_ids += [[0]] * n
        starts += range(context, context + n)
        tables += [table] * n
    inputs = BatchInputs.build(token_ids, starts, tables, [1] * len(starts), BLOCK)
    return inputs, k_cache, v_cache


def _row_by_row(
    kernel: PagedDecodeKernel,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    inputs: BatchInputs,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Each row attended alone: a call of one row, today's computation of that row."""
    scale = q.shape[-1] ** -0.5
    outs = []
    for i in range(q.shape[0]):
        tables, lens = inputs.block_tables[i : i + 1], inputs.seq_lens[i : i + 1]
        outs.append(kernel(q[i : i + 1], k_cache, v_cache, tables, lens, scale, window, softcap))
    return torch.cat(outs)


SHAPES = [(9, 3, 64), (4, 4, 64), (8, 4, 128), (8, 2, 64), (16, 2, 128), (10, 2, 32), (12, 2, 64)]
SHAPE_IDS = ["g3-d64", "g1-d64", "g2-d128", "g4-d64", "g8-d128", "g5-d32-generic", "g6-d64-generic"]


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    "window,softcap",
    [(None, None), (20, None), (None, 2.0), (7, 30.0)],
    ids=["", "window", "softcap", "both"],
)
def test_every_row_of_a_verify_run_is_the_same_bits_as_alone(
    kernel: PagedDecodeKernel,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    window: int | None,
    softcap: float | None,
) -> None:
    """Runs of 1 to 9 rows and ordinary decode rows in one call, contexts across page boundaries."""
    runs = [5, 1, 9, 2, 1, 3, 7, 4, 1, 6, 8]
    inputs, k_cache, v_cache = _step(runs, kv_heads, head_dim, dtype, seed=heads * head_dim)
    q = torch.randn(inputs.num_tokens, heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    together = kernel(
        q, k_cache, v_cache, inputs.block_tables, inputs.seq_lens, head_dim**-0.5, window, softcap
    )
    alone = _row_by_row(kernel, q, k_cache, v_cache, inputs, window, softcap)
    assert not together.isnan().any()
    assert torch.equal(together, alone)
    tiles = kernel.decode_tiles(inputs.block_tables, inputs.seq_lens, BLOCK, heads // kv_heads, kv_heads, 2)
    if heads // kv_heads <= 3:  # tiles of several rows (RUN_ROWS) with AVX-512's registers and AVX2's
        assert max(len(tile) for tile in tiles) > 1


def test_a_nan_in_the_last_row_s_key_reaches_that_row_only(kernel: PagedDecodeKernel) -> None:
    """The rows before the last of a run never see its key, not even times 0: a NaN there (a model that
    overflowed) leaves them as they are alone."""
    inputs, k_cache, v_cache = _step([6], 3, 64, torch.float32, seed=5)
    last = int(inputs.seq_lens[-1]) - 1
    block, row = int(inputs.block_tables[-1, last // BLOCK]), last % BLOCK
    v_cache[block, :, row] = float("nan")
    q = torch.randn(6, 9, 64, generator=torch.Generator().manual_seed(2))
    together = kernel(q, k_cache, v_cache, inputs.block_tables, inputs.seq_lens, 0.125, None)
    alone = _row_by_row(kernel, q, k_cache, v_cache, inputs, None, None)
    assert together[-1].isnan().all()
    assert not together[:-1].isnan().any()
    assert torch.equal(together[:-1], alone[:-1])


def _sequences(inputs: BatchInputs, tiles: list[list[int]]) -> list[list[int]]:
    """Each tile's rows as their KV lengths."""
    return [[int(inputs.seq_lens[r]) for r in tile] for tile in tiles]


def test_a_run_s_rows_share_tiles_as_registers_allow(kernel: PagedDecodeKernel) -> None:
    """Group 3 (the default model's): tiles of at most 4 rows on AVX-512, 2 on AVX2 (RUN_ROWS), cut into
    near-equal tiles; an ordinary row alone; the rows of each tile in ascending KV length."""
    tables = torch.tensor([[4, 9, 2]] * 5 + [[7, 1, 3]])
    lens = torch.tensor([20, 21, 22, 23, 24, 22])
    tiles = kernel.decode_tiles(tables, lens, BLOCK, group=3, num_kv_heads=3, threads=1)
    assert sorted(r for tile in tiles for r in tile) == list(range(6))
    assert [5] in tiles
    run = [tile for tile in tiles if 5 not in tile]
    assert [r for tile in run for r in tile] == [0, 1, 2, 3, 4]
    assert [len(tile) for tile in run] in ([3, 2], [2, 2, 1])  # AVX-512, AVX2


def test_rows_of_other_sequences_between_a_run_s_rows_do_not_split_it(kernel: PagedDecodeKernel) -> None:
    """The engine orders rows by KV length, so other sequences' rows of the same lengths sit between a
    run's; sequences sharing the run's first pages (a shared prompt) are not taken for it."""
    run, shared = [5, 6, 7], [[5, 6, 11], [5, 6, 12]]
    starts = [40, 41, 42, 43, 40, 41, 42]  # a run at 40..43, ordinary rows at 40, 41, 42
    tables = [run] * 4 + shared + [[1, 2, 3]]
    inputs = BatchInputs.build([[0]] * 7, starts, tables, [1] * 7, BLOCK)
    assert inputs.seq_lens.tolist() == [41, 41, 42, 42, 43, 43, 44]  # the run's rows interleaved
    tiles = kernel.decode_tiles(inputs.block_tables, inputs.seq_lens, BLOCK, 3, num_kv_heads=3, threads=1)
    grouped = [tile for tile in tiles if len(tile) > 1]
    assert [int(inputs.seq_lens[r]) for tile in grouped for r in tile] == [41, 42, 43, 44]
    assert all(inputs.block_tables[r].tolist() == run for tile in grouped for r in tile)
    assert len(tiles) == len(grouped) + 3


def test_only_consecutive_lengths_over_the_same_pages_make_a_run(kernel: PagedDecodeKernel) -> None:
    same = [[3, 8, 1]] * 2
    assert kernel.decode_tiles(torch.tensor(same), torch.tensor([30, 31]), BLOCK, 3, 3, 1) == [[0, 1]]
    assert kernel.decode_tiles(torch.tensor(same), torch.tensor([30, 32]), BLOCK, 3, 3, 1) == [[0], [1]]
    other = [[3, 8, 1], [3, 9, 1]]
    assert kernel.decode_tiles(torch.tensor(other), torch.tensor([30, 31]), BLOCK, 3, 3, 1) == [[0], [1]]


def test_idle_threads_split_runs_down_to_a_row_per_tile(kernel: PagedDecodeKernel) -> None:
    """One sequence's run of 5 rows over 3 KV heads: with 16 threads every row is its own tile (15 items,
    as without runs); with 8, three tiles (9 items); with one, as few tiles as registers allow."""
    tables, lens = torch.tensor([[4, 9, 2]] * 5), torch.tensor([30, 31, 32, 33, 34])
    assert kernel.decode_tiles(tables, lens, BLOCK, 3, 3, threads=16) == [[0], [1], [2], [3], [4]]
    assert [len(t) for t in kernel.decode_tiles(tables, lens, BLOCK, 3, 3, threads=8)] == [2, 2, 1]
    assert len(kernel.decode_tiles(tables, lens, BLOCK, 3, 3, threads=1)) < 5
