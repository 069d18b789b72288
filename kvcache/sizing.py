"""The arithmetic of KV-cache sizing: how many bytes one block takes, how many blocks a budget holds, how
many blocks a sequence needs."""

from __future__ import annotations


class CacheTooSmallError(ValueError):
    """The memory budget for the KV cache does not hold a single block."""


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


def bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int
) -> int:
    """Bytes of one block across all layers, K and V: ``2 * layers * block_size * kv_heads * head_dim *
    dtype_bytes`` (each layer's K and V hold ``block_size * num_kv_heads * head_dim`` values per block)."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("block_size", block_size),
        ("dtype_bytes", dtype_bytes),
    ):
        _positive(name, value)
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def num_blocks_for_budget(
    budget_bytes: float, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int
) -> int:
    """How many whole blocks fit in ``budget_bytes``. Raises ``CacheTooSmallError`` when none does."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    per_block = bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype_bytes)
    num_blocks = int(budget_bytes // per_block)
    if num_blocks < 1:
        raise CacheTooSmallError(
            f"a KV-cache budget of {budget_bytes} bytes holds no block: one block of {block_size} tokens takes "
            f"{per_block} bytes ({num_layers} layers x K,V x {num_kv_heads} kv heads x {head_dim} head dim x "
            f"{dtype_bytes} bytes). Give the cache more memory or use a smaller block_size."
        )
    return num_blocks
