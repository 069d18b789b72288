"""Large, long-lived CPU tensors (the KV cache, the packed weights) on transparent huge pages.

A decode step on the CPU streams the whole KV cache of its sequences and every weight once: hundreds of MB
in 4 KiB pages, scattered for the cache (a sequence's blocks lie anywhere). Each page is a TLB entry, and
the hardware prefetchers stop at page ends. Backed by 2 MiB pages, the same reads took 4-7% less time for
a 16-row decode step's matmuls and 11-25% less for its decode attention on the 2-core AVX2 machine
(docs/BENCHMARKS.md).

Linux gives huge pages to anonymous memory either always or, as most distributions ship it, only where the
process asks with ``madvise(MADV_HUGEPAGE)`` (``/sys/kernel/mm/transparent_hugepage/enabled``: madvise).
``empty`` allocates with 2 MiB alignment and asks before the first touch. Where the kernel refuses (no THP,
not Linux) the tensor is the same, only on small pages.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import sys
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def _advise(address: int, nbytes: int) -> bool:
    """Ask for huge pages under the whole 2 MiB pages in ``[address, address + nbytes)``; whether the
    kernel accepted."""
    madvise = _madvise()
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if madvise is None or end <= start:
        return False
    return madvise(start, end - start, MADV_HUGEPAGE) == 0


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype)`` on the CPU, 2 MiB-aligned and on huge pages where the kernel grants
    them (its memory not yet touched). Tensors under 2 MiB are plain ``torch.empty``."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or _madvise() is None:
        return torch.empty(tuple(shape), dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # room to align the start
    offset = -raw.data_ptr() % HUGE_PAGE
    t = raw[offset : offset + nbytes].view(dtype).view(tuple(shape))
    if not _advise(t.data_ptr(), nbytes):
        logger.debug("madvise(MADV_HUGEPAGE) refused; %d MB stay on small pages", nbytes >> 20)
    return t


def empty_many(shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Contiguous tensors of ``shapes``, back to back in one ``empty`` allocation (one alignment's slack for
    all of them)."""
    sizes = [math.prod(s) for s in shapes]
    arena = empty((sum(sizes),), dtype)
    out, start = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        out.append(arena[start : start + size].view(tuple(shape)))
        start += size
    return out
