"""Paged attention over ``KVCache`` block tensors (see ``paged.py``), with a kernel for the decode part chosen
by ``backend.py``: C on the CPU (``cpu_kernel.py``), Triton on CUDA (``triton_decode.py``), both
``DecodeKernel``s (``decode_kernel.py``)."""

from engine.executor.attention.backend import ATTENTION_BACKENDS, select_decode_kernel
from engine.executor.attention.cpu_kernel import KernelUnavailable, PagedDecodeKernel
from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.attention.paged import PagedAttentionMetadata, paged_attention, write_kv

__all__ = [
    "ATTENTION_BACKENDS",
    "DecodeKernel",
    "KernelUnavailable",
    "PagedAttentionMetadata",
    "PagedDecodeKernel",
    "paged_attention",
    "select_decode_kernel",
    "write_kv",
]
