"""The GPU decode-attention kernel, in Triton: each decoding sequence's one query attends over its KV pages
read in place through its block table.

Why a kernel: the PyTorch path gathers every sequence's pages into a padded copy, transposes it into
SDPA's layout (a second copy) and then runs SDPA over it: three passes over the cache per layer plus the
padding. On an H200 with a dummy Llama-3-8B (64 sequences, ~540 tokens of context) those copies took
64% of a decode step's GPU time. Here each K/V page is read once.

One program per (sequence, KV head, split): the ``group`` query heads that share the KV head are the rows
of one ``tl.dot`` (padded to 16, the smallest tile), so a KV tile is loaded once for the whole group
(GQA). The sequence's tokens are cut into ``num_splits`` contiguous ranges (flash-decoding) so that few long
sequences still fill the GPU; each split keeps an online softmax (running max ``m``, sum ``l``, weighted
values ``acc``) over tiles of ``BLOCK_N`` tokens, and a second small kernel merges the splits.

Cache layout (engine/executor/kv_cache.py): K ``[num_blocks, num_kv_heads, head_dim, block_size]``, V
``[num_blocks, num_kv_heads, block_size, head_dim]``; token ``t`` of a sequence is row ``t % block_size``
of block ``block_tables[seq, t // block_size]``. A tile of ``BLOCK_N`` tokens is ``BLOCK_N / block_size``
whole pages (``BLOCK_N`` is at least a page; tiles start on page boundaries). One KV head's page is
``head_dim * block_size`` contiguous elements in both caches, so a tile is loaded as ``[pages, page]``: one
block id a page, each page one flat run of 16-byte vectors, reshaped into the dots' tiles afterwards. (On an
H200, Llama-3-8B's attention over 64 sequences of 1,025 tokens: 119 us a layer when each page was loaded as
``[head_dim, rows]``, whose pointers took 255 registers a thread and whose loads ncu found 77% excess
sectors; 89 us flat, 3.0 TB/s. Before that, gathering a block id per token took 10.7 ms a decode step.)

Triton is imported on first use: CPU-only installs never need it (engine/executor/attention/backend.py picks this
kernel only for CUDA tensors, when Triton imports).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from engine.cpu.native_build import KernelUnavailable

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_ROWS = 16  # tl.dot's smallest tile: the query heads of a group are padded to this
MAX_GROUP = 64
MAX_SPLITS = 16  # a sequence's tokens are cut into at most this many splits
NO_WINDOW = 1 << 40  # the window passed when there is none: longer than any sequence


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.cache  # NOTE: one set of JIT functions per process, so their compiled variants are shared
def _kernels() -> tuple[Any, Any, Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def write_slots(
        k_ptr,  # [num_tokens, kv_heads, head_dim] (any strides but the last)
        v_ptr,
        k_cache_ptr,  # [num_blocks, kv_heads, head_dim, block_size]
        v_cache_ptr,  # [num_blocks, kv_heads, block_size, head_dim]
        slots_ptr,  # [num_tokens] int64: block * block_size + row; a negative slot is padding: skipped
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_kb,
        stride_kch,
        stride_kd,
        stride_vb,
        stride_vch,
        stride_vr,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        token = tl.program_id(0)
        kv_head = tl.program_id(1)
        slot = tl.load(slots_ptr + token)
        block = slot // BLOCK_SIZE
        row = slot % BLOCK_SIZE
        dims = tl.arange(0, HEAD_DIM)
        real = dims < tl.where(slot >= 0, HEAD_DIM, 0)  # all lanes of a real slot, none of a padding one
        k = tl.load(k_ptr + token * stride_kt + kv_head * stride_kh + dims)
        tl.store(
            k_cache_ptr + block * stride_kb + kv_head * stride_kch + dims * stride_kd + row, k, mask=real
        )
        v = tl.load(v_ptr + token * stride_vt + kv_head * stride_vh + dims)
        tl.store(
            v_cache_ptr + block * stride_vb + kv_head * stride_vch + row * stride_vr + dims, v, mask=real
        )

    @triton.jit
    def decode_split(
        q_ptr,  # [num_seqs, num_heads, head_dim]
        k_ptr,  # [num_blocks, kv_heads, head_dim, block_size]: each (block, kv head) page contiguous
        v_ptr,  # [num_blocks, kv_heads, block_size, head_dim]: each (block, kv head) page contiguous
        tables_ptr,  # [num_seqs, max_pages] int64
        seq_lens_ptr,  # [num_seqs] int64
        part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32
        part_max_ptr,  # [num_seqs, num_heads, num_splits] float32
        part_sum_ptr,  # [num_seqs, num_heads, num_splits] float32
        scale,
        window,  # the sliding window; longer than any sequence when there is none
        stride_qs,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_vb,
        stride_vh,
        stride_bs,
        num_splits,
        GROUP: tl.constexpr,
        ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
        FIXED_TILES: tl.constexpr,  # tiles a split (batch-invariant), or 0: the sequence's tiles over num_splits
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens_ptr + seq)
        first = tl.maximum(seq_len - window, 0)
        # this split's tokens: [lo, hi), whole tiles of BLOCK_N from the tile holding `first` (tiles start on
        # page boundaries; the tokens before `first` are masked)
        base = (first // BLOCK_N) * BLOCK_N
        if FIXED_TILES > 0:
            tiles_per_split = FIXED_TILES
        else:
            tiles_per_split = tl.cdiv(tl.cdiv(seq_len - base, BLOCK_N), num_splits)
        lo = base + split * tiles_per_split * BLOCK_N
        hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq_len)

        rows = tl.arange(0, ROWS)  # query heads of the group (padded)
        dims = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + rows
        row_ok = rows < GROUP
        q = tl.load(
            q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )  # [ROWS, HEAD_DIM]

        m = tl.full([ROWS], -1.0e30, dtype=tl.float32)
        l = tl.zeros([ROWS], dtype=tl.float32)  # noqa: E741 (the paper's name)
        acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
        # a tile is PAGES whole pages, and a page of one KV head is HEAD_DIM * BLOCK_SIZE contiguous elements
        # (K: [HEAD_DIM, BLOCK_SIZE], V: [BLOCK_SIZE, HEAD_DIM]): each page is loaded as one flat run (one
        # block id a page; 16-byte vectors, one address a vector) and only then reshaped into the dots' tiles
        PAGES: tl.constexpr = BLOCK_N // BLOCK_SIZE
        PAGE: tl.constexpr = HEAD_DIM * BLOCK_SIZE
        tile_pages = tl.arange(0, PAGES)
        flat = tl.arange(0, PAGE)
        tile_tokens = tl.arange(0, BLOCK_N)
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_vh
        for start in range(lo, hi, BLOCK_N):
            page = start // BLOCK_SIZE + tile_pages  # [PAGES]
            # a page past `hi` reads block 0 (any memory of the cache): its tokens are masked below
            block = tl.load(tables_ptr + seq * stride_bs + page, mask=page * BLOCK_SIZE < hi, other=0)
            k = tl.load(k_base + block[:, None] * stride_kb + flat[None, :])  # [PAGES, PAGE]
            k = tl.permute(tl.reshape(k, (PAGES, HEAD_DIM, BLOCK_SIZE)), (1, 0, 2))
            k = tl.reshape(k, (HEAD_DIM, BLOCK_N))
            tok = start + tile_tokens
            tile_ok = (tok >= first) & (tok < hi)
            if IEEE:
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = tl.where(tile_ok[None, :], s * scale, float("-inf"))  # [ROWS, BLOCK_N]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
            v = tl.load(v_base + block[:, None] * stride_vb + flat[None, :])  # [PAGES, PAGE]
            # masked rows may hold anything (another sequence's tokens, stale or non-finite values): zeroed,
            # since 0 * inf is not 0
            v = tl.where(tile_ok[:, None], tl.reshape(v, (BLOCK_N, HEAD_DIM)), 0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new

        part = (seq * (GROUP * tl.num_programs(1)) + heads) * num_splits + split  # [ROWS]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_max_ptr + part, m, mask=row_ok)
        tl.store(part_sum_ptr + part, l, mask=row_ok)

    @triton.jit
    def merge_splits(
        part_out_ptr,  # [num_seqs * num_heads, num_splits, head_dim] float32
        part_max_ptr,  # [num_seqs * num_heads, num_splits]
        part_sum_ptr,
        out_ptr,  # [num_seqs, num_heads, head_dim]
        num_splits,
        SPLITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        row = tl.program_id(0)  # seq * num_heads + head
        splits = tl.arange(0, SPLITS)
        dims = tl.arange(0, HEAD_DIM)
        ok = splits < num_splits
        m = tl.load(part_max_ptr + row * num_splits + splits, mask=ok, other=-1.0e30)
        l = tl.load(part_sum_ptr + row * num_splits + splits, mask=ok, other=0.0)  # noqa: E741
        weight = tl.exp(m - tl.max(m, axis=0))  # [SPLITS]; an empty split has l = 0 and acc = 0
        acc = tl.load(
            part_out_ptr + (row * num_splits + splits[:, None]) * HEAD_DIM + dims[None, :],
            mask=ok[:, None],
            other=0.0,
        )
        out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
        tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def merge_splits_in_order(
        part_out_ptr,  # [num_seqs * num_heads, num_splits, head_dim] float32
        part_max_ptr,  # [num_seqs * num_heads, num_splits]
        part_sum_ptr,
        out_ptr,  # [num_seqs, num_heads, head_dim]
        num_splits,
        HEAD_DIM: tl.constexpr,
    ):
        """The splits folded one after another from the first (never empty: it holds the sequence's first
        token). An empty split past the sequence's end (m = -1e30, l = 0, acc = 0) leaves the running sums
        exactly as they were, so the result does not depend on how many splits the step made."""
        row = tl.program_id(0)
        dims = tl.arange(0, HEAD_DIM)
        first = row * num_splits
        m = tl.load(part_max_ptr + first)
        l = tl.load(part_sum_ptr + first)  # noqa: E741
        acc = tl.load(part_out_ptr + first * HEAD_DIM + dims)
        for split in range(1, num_splits):
            m_split = tl.load(part_max_ptr + first + split)
            l_split = tl.load(part_sum_ptr + first + split)
            acc_split = tl.load(part_out_ptr + (first + split) * HEAD_DIM + dims)
            m_new = tl.maximum(m, m_split)
            alpha, beta = tl.exp(m - m_new), tl.exp(m_split - m_new)
            acc = acc * alpha + acc_split * beta
            l = l * alpha + l_split * beta  # noqa: E741
            m = m_new
        tl.store(out_ptr + row * HEAD_DIM + dims, (acc / l).to(out_ptr.dtype.element_ty))

    return write_slots, decode_split, merge_splits, merge_splits_in_order


class TritonDecodeKernel:
    """Decode attention over paged K/V on a GPU (``__call__``); ``write_kv`` stores the step's new K/V."""

    name = "triton"
    # Launch parameters, the best of 91 measured by bench/triton_decode_tune.py on an H200 (Llama-3-8B's
    # attention, 1-256 sequences of 576-4096 tokens; docs/BENCHMARKS.md): splits are added until there are
    # `programs_per_sm` programs per multiprocessor, as long as each split keeps `tokens_per_split` tokens.
    # Two pipeline stages and two warps halved the time of Triton's defaults (3 stages, 4 warps) there.
    programs_per_sm = 4
    tokens_per_split = 512
    block_n = 64  # tokens per tile (at least one page)
    num_warps = 2
    num_stages: int | None = 2  # None: Triton's default
    batch_invariant = False  # a query's result depends on the step's split count (BatchInvariantTritonKernel)

    def __init__(self) -> None:
        try:
            self._write, self._split, self._merge, self._merge_in_order = _kernels()
        except ImportError as e:
            raise KernelUnavailable(f"Triton is not installed ({e})") from e

    def unsupported(
        self, head_dim: int, block_size: int, group: int, dtype: torch.dtype, softcap: float | None = None
    ) -> str | None:
        """Why this configuration cannot use the kernel, or None when it can."""
        if softcap is not None:  # NOTE: not in the kernel; SDPA's path computes it (paged.py)
            return f"attention logit soft-capping (softcap={softcap})"
        if dtype not in SUPPORTED_DTYPES:
            return f"dtype {dtype} (supported: float32, bfloat16, float16)"
        if not _power_of_two(head_dim) or head_dim < 16:
            return f"head_dim {head_dim} (a power of two >= 16)"
        if not _power_of_two(block_size):
            return f"block_size {block_size} (a power of two)"
        if group > MAX_GROUP:
            return f"{group} query heads per KV head (at most {MAX_GROUP})"
        return None

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store the new tokens' keys/values ``[num_tokens, num_kv_heads, head_dim]`` into their ``slots``
        (``block * block_size + row``; a negative slot is a padding row, not written), one launch for both
        (``index_put_`` takes two, plus the index math).
        The caches must be contiguous, and ``k``/``v`` contiguous along ``head_dim``."""
        num_tokens, num_kv_heads, head_dim = k.shape
        if num_tokens == 0:
            return
        if k.stride(2) != 1:
            k = k.contiguous()
        if v.stride(2) != 1:
            v = v.contiguous()
        self._write[(num_tokens, num_kv_heads)](
            k,
            v,
            k_cache,
            v_cache,
            slots,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            BLOCK_SIZE=k_cache.shape[-1],
            HEAD_DIM=head_dim,
        )

    def __call__(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, num_pages] int64
        seq_lens: torch.Tensor,  # [num_seqs] int64
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """``[num_seqs, num_heads, head_dim]``: each query over its sequence's first ``seq_lens`` tokens (the
        last ``sliding_window`` of them when set). The table's width (pages of the longest sequence) sizes
        the splits. ``softcap`` is refused (``unsupported`` says so at start)."""
        if softcap is not None:
            raise ValueError("the Triton decode kernel does not soft-cap attention logits")
        num_seqs, num_heads, head_dim = q.shape
        _, num_kv_heads, _, block_size = k_cache.shape
        group = num_heads // num_kv_heads
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if num_seqs == 0:
            return out
        if q.stride(2) != 1:
            q = q.contiguous()
        _check_pages_contiguous(k_cache, v_cache)
        longest = block_tables.shape[1] * block_size
        if sliding_window is not None:
            longest = min(longest, sliding_window)
        num_splits = self._num_splits(num_seqs * num_kv_heads, longest, q.device)
        block_n = max(self.block_n, block_size)
        options = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        parts = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        self._split[(num_seqs, num_kv_heads, num_splits)](
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            parts,
            part_max,
            part_sum,
            scale,
            sliding_window or NO_WINDOW,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            v_cache.stride(0),
            v_cache.stride(1),
            block_tables.stride(0),
            num_splits,
            GROUP=group,
            ROWS=max(MIN_ROWS, _next_power_of_two(group)),
            HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size,
            BLOCK_N=block_n,
            IEEE=q.dtype == torch.float32,
            FIXED_TILES=self._fixed_tiles(block_n),
            **options,
        )
        self._merge_splits(parts, part_max, part_sum, out, num_splits)
        return out

    def _num_splits(self, programs: int, longest: int, device: torch.device) -> int:
        """Enough programs to fill the GPU even for a few long sequences, never splits of a few tokens."""
        wanted = math.ceil(self.programs_per_sm * _num_sms(device) / programs)
        return max(1, min(wanted, MAX_SPLITS, math.ceil(longest / self.tokens_per_split)))

    def _fixed_tiles(self, block_n: int) -> int:
        return 0  # a sequence's tiles are shared out over the splits

    def _merge_splits(
        self,
        parts: torch.Tensor,
        part_max: torch.Tensor,
        part_sum: torch.Tensor,
        out: torch.Tensor,
        num_splits: int,
    ) -> None:
        num_seqs, num_heads, _, head_dim = parts.shape
        self._merge[(num_seqs * num_heads,)](
            parts,
            part_max,
            part_sum,
            out,
            num_splits,
            SPLITS=_next_power_of_two(num_splits),
            HEAD_DIM=head_dim,
        )


class BatchInvariantTritonKernel(TritonDecodeKernel):
    """The same kernel with one reduction order per query whatever shares its step (``--batch-invariant``):

    - every split is ``tokens_per_split`` tokens from the sequence's first (split ``s`` always covers the
      same tokens), however many sequences or splits the step has; the splits are folded in order;
    - prefill runs here too: each new token's query is a decode query of its own over the pages up to its
      position, so a prompt's rows do not depend on how its prefill was chunked or what shared the step.

    The prefill is slower than SDPA's (each query reads its keys itself): the price of the guarantee."""

    batch_invariant = True

    def _num_splits(self, programs: int, longest: int, device: torch.device) -> int:
        return max(1, math.ceil(longest / self.tokens_per_split))

    def _fixed_tiles(self, block_n: int) -> int:
        return max(1, self.tokens_per_split // block_n)

    def _merge_splits(
        self,
        parts: torch.Tensor,
        part_max: torch.Tensor,
        part_sum: torch.Tensor,
        out: torch.Tensor,
        num_splits: int,
    ) -> None:
        num_seqs, num_heads, _, head_dim = parts.shape
        self._merge_in_order[(num_seqs * num_heads,)](
            parts, part_max, part_sum, out, num_splits, HEAD_DIM=head_dim
        )

    def prefill(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, pages of the longest] int64
        query_starts: torch.Tensor,  # [num_seqs + 1] int64 (host)
        seq_lens: torch.Tensor,  # [num_seqs] int64: KV length with the new tokens
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of each sequence's new queries (``PrefillKernel``): row ``i`` of sequence ``s``
        is a decode query over the first ``seq_lens[s] - (its rows after i)`` tokens of ``s``'s pages."""
        num_tokens = q.shape[0]
        starts = query_starts.to(q.device, non_blocking=True)
        seq_of_row = torch.repeat_interleave(
            torch.arange(len(starts) - 1, device=q.device), starts[1:] - starts[:-1], output_size=num_tokens
        )  # [num_tokens]
        ends = starts[1:][seq_of_row]  # one past the row's sequence
        rows = torch.arange(num_tokens, device=q.device)
        kv_lens = seq_lens[seq_of_row] - (ends - 1 - rows)  # [num_tokens]: the row's position + 1
        return self(q, k_cache, v_cache, block_tables[seq_of_row], kv_lens, scale, sliding_window, softcap)


def _check_pages_contiguous(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The kernel reads one KV head's page as one run: K ``[head_dim, block_size]`` and V ``[block_size,
    head_dim]`` row-major (as engine/executor/kv_cache.py allocates them)."""
    _, _, head_dim, block_size = k_cache.shape
    if k_cache.stride()[2:] != (block_size, 1) or v_cache.stride()[2:] != (head_dim, 1):
        raise ValueError(
            f"the Triton decode kernel needs contiguous pages; got K strides {k_cache.stride()} and V "
            f"strides {v_cache.stride()}"
        )


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # Triton's interpreter (tests on the CPU): any small number of "SMs"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def load(batch_invariant: bool = False) -> TritonDecodeKernel:
    """The kernel (``BatchInvariantTritonKernel`` with ``batch_invariant``), or ``KernelUnavailable`` with
    the reason (Triton missing)."""
    return BatchInvariantTritonKernel() if batch_invariant else TritonDecodeKernel()
