"""Large, long-lived CPU tensors (the KV cache, the packed weights) on transparent huge pages.

A decode step on the CPU streams the whole KV cache of its sequences and every weight once: hundreds of MB
in 4 KiB pages, scattered for the cache (a sequence's blocks lie anywhere). Each page is a TLB entry, and
the hardware prefetchers stop at page ends. Backed by 2 MiB pages, the same reads took 4-7% less time for
a 16-row decode step's matmuls and 11-25% less for its decode attention on the 2-core AVX2 machine
(docs/BENCHMARKS.md).

Linux gives huge pages to anonymous memory either always or, as most distributions ship it, only where the
process asks with ``madvise(MADV_HUGEPAGE)`` (``/sys/kernel/mm/transparent_hugepage/enabled``: madvise),
and only to pages not touched yet. ``empty`` therefore maps fresh private memory of its own (``mmap``, not
the heap, whose freed blocks are already touched), aligns the tensor to 2 MiB and asks before the first
touch. Where there is no ``MADV_HUGEPAGE`` (not Linux) it is a plain ``torch.empty``; where the kernel
refuses (THP off) the memory is the same, only on small pages.
"""

from __future__ import annotations

import logging
import math
import mmap
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor of ``shape`` (zeros, in fact: fresh anonymous memory), 2 MiB-aligned and on
    huge pages where the kernel grants them. Tensors under 2 MiB are plain ``torch.empty``."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or MADV_HUGEPAGE is None:
        return torch.empty(tuple(shape), dtype=dtype)
    # NOTE: MAP_PRIVATE: the module's default, MAP_SHARED, is shmem, which THP's "enabled" setting does not cover.
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # shares the mapping and keeps it alive
    offset = -raw.data_ptr() % HUGE_PAGE  # the mapping starts on a 4 KiB page: so does offset
    try:
        buf.madvise(MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError as e:
        logger.debug("madvise(MADV_HUGEPAGE) refused (%s); %d MB stay on small pages", e, nbytes >> 20)
    return raw[offset : offset + nbytes].view(dtype).view(tuple(shape))


def empty_many(shapes: Sequence[Sequence[int]], dtype: torch.dtype | Sequence[torch.dtype]) -> list[torch.Tensor]:
    """Contiguous tensors of ``shapes`` (of ``dtype``, or each of its own), back to back in one ``empty``
    allocation (one alignment's slack for all of them), each starting on a 64-byte boundary."""
    dtypes = [dtype] * len(shapes) if isinstance(dtype, torch.dtype) else list(dtype)
    sizes = [math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dtypes, strict=True)]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // 64) * 64)
    arena = empty((starts[-1],), torch.uint8)
    return [
        arena[start : start + size].view(d).view(tuple(shape))
        for shape, d, start, size in zip(shapes, dtypes, starts[:-1], sizes, strict=True)
    ]
