"""Paged attention over ``KVCache`` block tensors (see ``paged.py``)."""

from engine.attention.paged import PagedAttentionMetadata, paged_attention, write_kv

__all__ = ["PagedAttentionMetadata", "paged_attention", "write_kv"]
