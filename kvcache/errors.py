"""The errors of the KV-cache layer."""

from __future__ import annotations


class NoFreeBlocksError(RuntimeError):
    """An allocation asked for more blocks than are free. Check first (``can_allocate``,
    ``can_allocate_slots``)."""


class IntegrityError(RuntimeError):
    """An internal invariant does not hold: a bug, not a user error. Raised by ``check_integrity``."""
