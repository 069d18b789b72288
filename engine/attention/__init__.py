"""Paged attention over ``KVCache`` block tensors (see ``paged.py``), with a C kernel for the CPU decode part
(``cpu_kernel.py``) chosen by ``backend.py``."""

from engine.attention.backend import ATTENTION_BACKENDS, select_decode_kernel
from engine.attention.cpu_kernel import KernelUnavailable, PagedDecodeKernel
from engine.attention.paged import PagedAttentionMetadata, paged_attention, write_kv

__all__ = [
    "ATTENTION_BACKENDS",
    "KernelUnavailable",
    "PagedAttentionMetadata",
    "PagedDecodeKernel",
    "paged_attention",
    "select_decode_kernel",
    "write_kv",
]
