"""The hash chain of the prefix cache.

A full block is identified by the hash of its tokens chained with the hash of the block before it, so two
requests share block ``i`` only when their first ``(i + 1) * block_size`` tokens are equal. Partial blocks
are never hashed: their contents still change.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# NOTE: a cryptographic digest rather than Python's ``hash()``: tuple hashes of small ints collide on purpose
# (``hash(-1) == hash(-2)``) and can be forced to collide, and a collision would silently serve another
# prompt's KV. 128 bits of blake2b costs about a microsecond per block.
_DIGEST_SIZE = 16
_ROOT = b"\x00" * _DIGEST_SIZE


def hash_block(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The hash of a full block of ``tokens`` whose predecessor block hashed to ``parent`` (None for the
    first block). Deterministic across processes."""
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    h.update(_ROOT if parent is None else parent.to_bytes(_DIGEST_SIZE, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, known: Sequence[int] = (), max_blocks: int | None = None
) -> list[int]:
    """The chain of hashes of the full blocks of ``token_ids`` (at most ``max_blocks`` of them).

    ``known`` holds hashes already computed for a prefix of the same tokens; they are reused, so a caller
    that keeps a request's list can extend it incrementally as the request grows.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    hashes = list(known[:num_full])
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        parent = hash_block(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)
    return hashes
