"""Keep freed memory in the process instead of handing it back to the OS after every step.

Each forward allocates and frees tens of MB of temporaries (gathered KV pages, activations). With glibc's
defaults, blocks that size are mmap-ed and unmapped on free, or trimmed from the heap top, so every step
page-faults them in again: on a 2-core CPU that was over half of a decode step at long contexts
(docs/BENCHMARKS.md). Raising the mmap and trim thresholds makes them reusable heap memory, as a caching
allocator would (vLLM's CPU backend preloads tcmalloc for the same reason). Call it before the engine thread
starts: the arena setting only affects threads that have not allocated yet.

The one place where that keeps too much is loading: checking and packing the weights frees hundreds of MB
of temporaries (each quantized matrix dequantized to compare with the loaded weight, the packed copies'
intermediates) that no step would reuse. ``release_freed_memory`` hands those back once, after the load
(the default model in bfloat16 with its blocks: 2,299 -> 2,013 MB resident).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD = 32 << 20  # glibc's upper limit for this parameter on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

_configured = False


@functools.cache
def _glibc_function(name: str) -> Any:
    """glibc's function ``name`` through ctypes (its library looked up once a process), or None off glibc."""
    path = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    if path is None:
        return None
    try:
        return getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Tune glibc's allocator once per process; returns whether it applied (False off glibc)."""
    global _configured
    if _configured:
        return True
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD),
            # NOTE: one arena. The engine thread's arena would otherwise be a set of 64 MiB heaps, which
            # large temporaries overflow into fresh mmaps again.
            (M_ARENA_MAX, 1),
        )
    )
    if not ok:
        logger.warning("mallopt refused a setting; CPU steps may page-fault their temporaries")
    _configured = ok
    return ok


def release_freed_memory() -> bool:
    """Return the heap's free memory to the OS now (glibc's ``malloc_trim``); whether it ran (False off
    glibc). The thresholds stay raised: the steps' temporaries are kept again from their first step on."""
    trim = _glibc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
