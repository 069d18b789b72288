"""The paged KV cache tensors: for every layer a K and a V tensor of fixed-size blocks.

Layout: one allocation ``[num_layers, 2, num_blocks, block_numel]``; layer ``l``'s K cache is the contiguous
view ``[l, 0]`` and its V cache ``[l, 1]``, shaped per block and KV head so that decode attention reads
whole SIMD vectors (engine/executor/attention/csrc/paged_decode.c):

    K: [num_blocks, num_kv_heads, head_dim, block_size]   keys transposed: 16 keys' scores are 16 lanes
    V: [num_blocks, num_kv_heads, block_size, head_dim]   a value row is head_dim contiguous lanes

Token ``p`` of a sequence whose block table is ``table`` lives in row ``p % block_size`` of block
``table[p // block_size]`` (its slot: ``table[p // block_size] * block_size + p % block_size``) of every
layer's K and V.

Which block belongs to whom is decided by ``kvcache/`` and ``scheduler/`` (pure Python); this file only
owns the tensors.
"""

from __future__ import annotations

import os

import torch

from engine.cpu import huge_pages


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _free_memory_bytes(device: torch.device) -> int:
    """Free memory of ``device``: the CUDA allocator's view on GPUs, available RAM on the host."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    raise ValueError(f"cannot measure the free memory of device {device}; pass num_blocks or a byte budget")


class KVCache:
    """Per-layer K and V block tensors, allocated once (zeros) and reused for the engine's lifetime."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVCache: {name} must be a positive int, got {value!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"KVCache: dtype must be a floating point dtype, got {dtype}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # NOTE: one allocation so that a block copy (copy-on-write fork) is one indexing op over all layers.
        # On the CPU it is on huge pages: decode attention reads a sequence's blocks from all over it.
        shape = (num_layers, 2, num_blocks, num_kv_heads * head_dim * block_size)
        if self.device.type == "cpu":
            self.kv = huge_pages.empty(shape, dtype).zero_()  # [num_layers, 2, num_blocks, block_numel]
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k_caches: list[torch.Tensor] = [
            self.kv[i, 0].view(num_blocks, num_kv_heads, head_dim, block_size) for i in range(num_layers)
        ]
        self.v_caches: list[torch.Tensor] = [
            self.kv[i, 1].view(num_blocks, num_kv_heads, block_size, head_dim) for i in range(num_layers)
        ]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes over all layers, K and V."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * _dtype_size(dtype)

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        num_blocks: int | None = None,
        budget_bytes: int | None = None,
        memory_fraction: float | None = None,
    ) -> KVCache:
        """Size the cache by exactly one of: an explicit ``num_blocks``, a byte budget ``budget_bytes``, or
        ``memory_fraction`` of the device's currently free memory (``torch.cuda.mem_get_info`` on CUDA,
        available RAM on CPU). Raises ``ValueError`` when the choice is ambiguous or yields no block."""
        given = [x is not None for x in (num_blocks, budget_bytes, memory_fraction)]
        if sum(given) != 1:
            raise ValueError("KVCache.allocate: pass exactly one of num_blocks, budget_bytes, memory_fraction")
        dev = torch.device(device)
        per_block = cls.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        if budget_bytes is not None:
            if budget_bytes < 0:
                raise ValueError(f"KVCache.allocate: budget_bytes must be >= 0, got {budget_bytes}")
            num_blocks = budget_bytes // per_block
        elif memory_fraction is not None:
            if not 0.0 < memory_fraction <= 1.0:
                raise ValueError(f"KVCache.allocate: memory_fraction must be in (0, 1], got {memory_fraction}")
            num_blocks = int(_free_memory_bytes(dev) * memory_fraction) // per_block
        if num_blocks is None or num_blocks < 1:
            raise ValueError(
                f"KVCache.allocate: the budget holds no block ({per_block} bytes per block of {block_size} "
                f"tokens); give more memory or a smaller model/block size"
            )
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, dev)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s K cache ``[num_blocks, num_kv_heads, head_dim, block_size]`` and V cache
        ``[num_blocks, num_kv_heads, block_size, head_dim]``."""
        return self.k_caches[index], self.v_caches[index]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` to block ``dst`` in every layer, K and V, for each ``(src, dst)`` pair
        (copy-on-write of a shared partial block). Destinations must be distinct."""
        if not pairs:
            return
        src = [s for s, _ in pairs]
        dst = [d for _, d in pairs]
        for b in src + dst:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"KVCache.copy_blocks: block id {b} outside [0, {self.num_blocks})")
        if len(set(dst)) != len(dst):
            raise ValueError(f"KVCache.copy_blocks: duplicate destination blocks in {pairs}")
        src_t = torch.tensor(src, dtype=torch.int64, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.int64, device=self.device)
        # Gather first: a block that is both a source and a destination is read before it is overwritten.
        self.kv[:, :, dst_t] = self.kv[:, :, src_t]  # [num_layers, 2, num_pairs, block_numel]

    def __repr__(self) -> str:
        return (
            f"KVCache(num_layers={self.num_layers}, num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"device={self.device}, nbytes={self.nbytes})"
        )
