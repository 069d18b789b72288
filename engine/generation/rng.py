"""Per-request randomness that does not depend on the batch.

A sampled token is drawn by inverse-CDF from one uniform number, and that number is a pure function of
``(seed, sample_index, token_index)``: a counter-based generator (SplitMix64 finalizer over the three
values). So a seeded request gets the same tokens whatever else shares its batch, wherever its row sits,
whenever it runs, and after a preemption recomputes it. torch's global RNG is never touched.
"""

from __future__ import annotations

import secrets

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """SplitMix64's finalizer: a bijection on 64-bit ints with full avalanche."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return z ^ (z >> 31)


class RequestRNG:
    """Uniform draws for one sample of one request. ``seed=None`` draws a random seed now (from the
    OS, not from any global generator), so unseeded requests differ from each other."""

    def __init__(self, seed: int | None = None, sample_index: int = 0) -> None:
        if sample_index < 0:
            raise ValueError(f"sample_index must be >= 0, got {sample_index}")
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        self.sample_index = sample_index
        # NOTE: chain the mixes so (seed, index) pairs never collide the way seed + index would.
        self._key = _mix64(_mix64((self.seed & _MASK64) ^ _GOLDEN) ^ ((sample_index + 1) * _GOLDEN & _MASK64))

    def uniform(self, token_index: int) -> float:
        """A float in [0, 1) for the ``token_index``-th generated token (0-based), 53 random bits."""
        z = _mix64((self._key + (token_index + 1) * _GOLDEN) & _MASK64)
        return (z >> 11) * (1.0 / (1 << 53))

    def __repr__(self) -> str:
        return f"RequestRNG(seed={self.seed}, sample_index={self.sample_index})"
