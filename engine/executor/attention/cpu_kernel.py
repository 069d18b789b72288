"""The CPU attention kernels (``csrc/cpu_attention.c``: ``paged_decode.c`` and ``paged_prefill.c``): built
with the system C compiler on first use, cached on disk, called through ``ctypes`` (engine/cpu/native_build.py).

Why C: on the CPU, decode attention is bound by reading the KV pages. The PyTorch path gathers every
sequence's pages into a padded copy and then runs SDPA over it -- three passes over the cache per layer,
plus the padding. The kernel reads each page once, in place, through the block table.

``load()`` returns the kernel or raises ``KernelUnavailable`` with the reason (no compiler, a failed build);
callers that choose the backend automatically fall back to the PyTorch path on that error.

The same library writes each step's new K/V into their cache slots (``write_kv``): one pass over the new
tokens instead of two ``index_put_`` calls per layer, a tenth of a decode step's time saved
(measured: docs/benchmarks-log.md).

And it runs the prefill part of a batch (``prefill``): every sequence's new queries over its pages, causal,
in one call per layer instead of one SDPA call per sequence, each K/V page read once per tile of 16 queries
(measured against SDPA: ``python -m bench.prefill_attention_ab``, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.cpu.native_build import BuildOnce, KernelUnavailable
from engine.cpu.native_build import build as build_library

SOURCE = Path(__file__).with_name("csrc") / "cpu_attention.c"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# the products of a bfloat16 prefill's items, preferred first: paged_prefill_bf16.c's BF16_ON_TILES, BF16_ON_DOTS
BF16_PREFILL_KINDS = {"tiles": 2, "dots": 1}

__all__ = ["KernelUnavailable", "PagedDecodeKernel", "build", "load"]


def build(cc: str | None = None) -> Path:
    """Compile the kernel (or find it in the cache) and return the shared object's path."""
    return build_library(SOURCE, cc)


class PagedDecodeKernel:
    """``ctypes`` binding of ``cbserve_paged_decode_attention`` (a ``DecodeKernel``), of
    ``cbserve_paged_prefill_attention`` (a ``PrefillKernel``) and of ``cbserve_write_kv``."""

    name = "cpu"
    batch_invariant = True  # every reduction runs per query, in one order

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        fn = self._lib.cbserve_paged_decode_attention
        fn.restype = ctypes.c_int
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, ptr, i64, ptr, ptr, ctypes.c_int, ptr, i64, ptr, i64, i64, i64, i64, i64]
        fn.argtypes += [ctypes.c_float, i64, ctypes.c_float]
        self._fn = fn
        write = self._lib.cbserve_write_kv
        write.restype = ctypes.c_int
        write.argtypes = [ptr, ptr, ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64]
        self._write = write
        prefill = self._lib.cbserve_paged_prefill_attention
        prefill.restype = ctypes.c_int
        prefill.argtypes = [
            ptr,
            ptr,
            i64,
            ctypes.c_int,
            ptr,
            ptr,
            ctypes.c_int,
            ptr,
            i64,
            ptr,
            ptr,
            i64,
            i64,
            i64,
            i64,
            i64,
        ]
        prefill.argtypes += [ctypes.c_float, i64, ctypes.c_float]
        self._prefill = prefill
        tiles = self._lib.cbserve_decode_tiles
        tiles.restype = i64
        tiles.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, i64, ptr, ptr]
        self._tiles = tiles
        self.lanes = int(self._lib.cbserve_lanes())
        self.max_group = int(self._lib.cbserve_max_group())
        self.max_head_dim = int(self._lib.cbserve_max_head_dim())
        # bfloat16 prefills (head_dim a multiple of 32) on AMX tiles or AVX512-BF16 dot products:
        # csrc/paged_prefill_bf16.c
        self._bf16_takes = self._lib.cbserve_prefill_bf16_takes
        self._bf16_takes.restype = ctypes.c_int
        self._bf16_takes.argtypes = [i64, ctypes.c_int]
        self.prefill_kinds = [
            kind for kind in BF16_PREFILL_KINDS if self._bf16_takes(64, BF16_PREFILL_KINDS[kind])
        ]
        # the products a bfloat16 prefill runs on (the first of "tiles", "dots" built here); None: the vector
        # path in float32, as float16 or float32 prefills (set another for an A/B)
        self.bf16_prefill: str | None = self.prefill_kinds[0] if self.prefill_kinds else None

    @functools.cache  # noqa: B019 (one kernel per process)
    def bf16_takes(self, head_dim: int, kind: str) -> bool:
        """Whether a bfloat16 prefill of this head_dim runs on ``kind``'s products ("tiles", "dots") here."""
        return bool(self._bf16_takes(head_dim, BF16_PREFILL_KINDS[kind]))

    def unsupported(
        self, head_dim: int, block_size: int, group: int, dtype: torch.dtype, softcap: float | None = None
    ) -> str | None:
        """Why this configuration cannot use the kernel, or None when it can (any ``softcap``: the kernels
        soft-cap the scores)."""
        if dtype not in SUPPORTED_DTYPES:
            return f"dtype {dtype} (supported: float32, bfloat16)"
        if head_dim % self.lanes or head_dim > self.max_head_dim:
            return f"head_dim {head_dim} (must be a multiple of {self.lanes}, at most {self.max_head_dim})"
        if block_size % self.lanes:
            return f"block_size {block_size} (must be a multiple of {self.lanes})"
        if group > self.max_group:
            return f"{group} query heads per KV head (at most {self.max_group})"
        return None

    def __call__(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query per sequence
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim, block_size]
        v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        block_tables: torch.Tensor,  # [num_seqs, >= pages] int64
        seq_lens: torch.Tensor,  # [num_seqs] int64, >= 1
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Attention of each sequence's query over its pages: ``[num_seqs, num_heads, head_dim]`` in q's
        dtype. ``softcap``: scores become ``softcap * tanh(score / softcap)`` before the softmax."""
        num_seqs, num_heads, head_dim = q.shape
        num_blocks, num_kv_heads, _, block_size = k_cache.shape
        qf, tables = _checked_inputs(q, k_cache, v_cache, block_tables, seq_lens)
        lens = seq_lens.contiguous()
        out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float32)
        rc = self._fn(
            out.data_ptr(),
            qf.data_ptr(),
            qf.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            int(k_cache.dtype == torch.bfloat16),
            tables.data_ptr(),
            tables.stride(0),
            lens.data_ptr(),
            num_seqs,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            sliding_window or 0,
            softcap or 0.0,
        )
        _raise_for(rc, "decode", q.shape, k_cache.shape)
        return out if q.dtype == torch.float32 else out.to(q.dtype)

    def decode_tiles(
        self,
        block_tables: torch.Tensor,  # [num_seqs, >= pages] int64
        seq_lens: torch.Tensor,  # [num_seqs] int64, >= 1
        block_size: int,
        group: int,
        num_kv_heads: int,
        threads: int,
    ) -> list[list[int]]:
        """How a decode call on ``threads`` threads splits these rows into work items (each a tile x a KV
        head): the tiles' rows. Rows of one verify run (consecutive KV lengths over the same pages) share a
        tile, whose every K/V page is read once for all of them (csrc/paged_decode.c's plan_tiles)."""
        num_seqs = seq_lens.shape[0]
        tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
        if tables.dtype != torch.int64 or seq_lens.dtype != torch.int64:
            raise ValueError("block_tables and seq_lens must be int64")
        if tables.shape[0] != num_seqs or (num_seqs and int(seq_lens.max()) > tables.shape[1] * block_size):
            raise ValueError("one block table per row, wide enough for its pages")
        lens = seq_lens.contiguous()
        rows = torch.empty(num_seqs, dtype=torch.int64)
        starts = torch.empty(num_seqs + 1, dtype=torch.int64)
        count = self._tiles(
            tables.data_ptr(), tables.stride(0), lens.data_ptr(), num_seqs, block_size, group, num_kv_heads,
            threads, rows.data_ptr(), starts.data_ptr(),
        )  # fmt: skip
        if count < 0:
            raise MemoryError("decode tiles: out of memory")
        ids, bounds = rows.tolist(), starts[: count + 1].tolist()
        return [ids[bounds[i] : bounds[i + 1]] for i in range(count)]

    def prefill(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the sequences' new queries, one after another
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim, block_size]
        v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        block_tables: torch.Tensor,  # [num_seqs, >= pages] int64
        query_starts: torch.Tensor,  # [num_seqs + 1] int64: sequence s's queries are rows starts[s]:starts[s+1]
        seq_lens: torch.Tensor,  # [num_seqs] int64: KV length with the new tokens (already in the cache)
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention of each sequence's new queries over its pages (the query of row ``i`` of a
        sequence of ``q_len`` new tokens sits at position ``seq_len - q_len + i``): ``[num_tokens, num_heads,
        head_dim]`` in q's dtype. ``softcap`` as in ``__call__``."""
        num_tokens, num_heads, head_dim = q.shape
        num_blocks, num_kv_heads, _, block_size = k_cache.shape
        num_seqs = seq_lens.shape[0]
        # bfloat16 on tiles or dot products: q read and the output written in bfloat16; else both in float32
        kind = self.bf16_prefill if q.dtype == k_cache.dtype == torch.bfloat16 else None
        if kind is not None and not self.bf16_takes(head_dim, kind):
            kind = None
        qf, tables = _checked_inputs(
            q, k_cache, v_cache, block_tables, seq_lens, None if kind is None else torch.bfloat16
        )
        if query_starts.dtype != torch.int64:
            raise ValueError("query_starts must be int64")
        if query_starts.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
            raise ValueError("one block table and one query range per sequence")
        if int(query_starts[0]) != 0 or int(query_starts[-1]) != num_tokens:
            raise ValueError(f"the query ranges must cover the {num_tokens} query rows")
        starts, lens = query_starts.contiguous(), seq_lens.contiguous()
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=qf.dtype)
        rc = self._prefill(
            out.data_ptr(), qf.data_ptr(), qf.stride(0), BF16_PREFILL_KINDS[kind] if kind else 0,
            k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16), tables.data_ptr(),
            tables.stride(0), starts.data_ptr(), lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
            block_size, scale, sliding_window or 0, softcap or 0.0,
        )  # fmt: skip
        if rc == -5:
            raise ValueError("a sequence's query count or length does not fit its length or block table")
        _raise_for(rc, "prefill", q.shape, k_cache.shape)
        return out if out.dtype == q.dtype else out.to(q.dtype)

    def write_kv(
        self,
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim, block_size]
        v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        slots: torch.Tensor,  # [num_tokens] int64: block * block_size + row
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> None:
        """Store the new tokens' keys and values in their slots (one pass, no index tensors)."""
        num_blocks, num_kv_heads, head_dim, block_size = k_cache.shape
        num_tokens = k.shape[0]
        for name, x in (("k", k), ("v", v)):
            if x.shape != (num_tokens, num_kv_heads, head_dim) or x.dtype != k_cache.dtype:
                raise ValueError(
                    f"{name}: {tuple(x.shape)} {x.dtype}, expected "
                    f"{(num_tokens, num_kv_heads, head_dim)} {k_cache.dtype}"
                )
            if x.stride(2) != 1 or x.stride(1) != head_dim:
                raise ValueError(f"{name}: each token's heads must be contiguous rows")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype):
            raise ValueError("the K and V caches must be contiguous tensors of one dtype")
        if slots.dtype != torch.int64 or slots.shape != (num_tokens,) or not slots.is_contiguous():
            raise ValueError("slots must be a contiguous int64 vector, one per token")
        rc = self._write(
            k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            slots.data_ptr(), num_tokens, num_blocks, num_kv_heads, head_dim, block_size, k.element_size(),
        )  # fmt: skip
        if rc == -3:
            raise ValueError(f"a slot is outside the cache's {num_blocks * block_size} slots")
        if rc != 0:
            raise KernelUnavailable(f"write_kv: unsupported element size {k.element_size()}")


def _checked_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What both attention kernels check and pass: float32 (or ``q_dtype``) queries with contiguous heads,
    contiguous caches of one dtype, int64 tables (rows contiguous) and lengths. Returns (queries, tables)."""
    head_dim = q.shape[-1]
    qf = q.to(q_dtype or torch.float32)
    if qf.stride(-1) != 1 or qf.stride(-2) != head_dim:
        qf = qf.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype):
        raise ValueError("the K and V caches must be contiguous tensors of one dtype")
    if block_tables.dtype != torch.int64 or seq_lens.dtype != torch.int64:
        raise ValueError("block_tables and seq_lens must be int64")
    return qf, block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()


def _raise_for(rc: int, what: str, q_shape: torch.Size, k_cache_shape: torch.Size) -> None:
    """The error of a kernel's return code (0: none): -2 a shape it does not take, else out of memory."""
    if rc == -2:
        _, num_heads, head_dim = q_shape
        _, num_kv_heads, _, block_size = k_cache_shape
        raise KernelUnavailable(
            f"unsupported shape: heads {num_heads}/{num_kv_heads}, head_dim {head_dim}, block {block_size}"
        )
    if rc != 0:
        raise MemoryError(f"paged {what} attention: out of memory for its scratch buffers")


# The kernel, built once per process; raises ``KernelUnavailable`` with the reason when it cannot be.
load = BuildOnce(SOURCE, PagedDecodeKernel)
