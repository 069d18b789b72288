"""Which vector instructions run beside the AMX tile unit on this core, and which wait for it
(bench/csrc/amx_overlap.c): why csrc/amx_qgemm.c expands its weight tiles with permutes rather than
multiply-adds.

    python -m bench.amx_overlap [--counts 16 32 64] [--rounds 5] [--iters 200000]

For each instruction kind and count: the time stamp counter ticks of a loop iteration with those
instructions alone, with one TDPBF16PS (16 x 16 x 32 bfloat16) beside them, and of the TDPBF16PS alone
(best of the rounds, interleaved). ``hidden`` is the share of the shorter of the two that the pair hides:
1 where they overlap entirely (the pair takes as long as the longer), 0 where the pair takes their sum.
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

from engine.cpu.native_build import BuildOnce, KernelUnavailable

SOURCE = Path(__file__).parent / "csrc" / "amx_overlap.c"
KINDS = ("VFMADD231PS", "VCVTNE2PS2BF16", "VPERMW", "VPSHUFB", "VPTERNLOGD", "store (VMOVDQA64)")


class Overlap:
    """``ctypes`` binding of bench/csrc/amx_overlap.c."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        if not lib.cbserve_overlap_available():
            raise KernelUnavailable(
                "no AMX-BF16 tiles and AVX512-BF16 on this CPU (or no tiles for this process)"
            )
        if lib.cbserve_overlap_kinds() != len(KINDS):
            raise RuntimeError("amx_overlap.c and amx_overlap.py disagree on the instruction kinds")
        self._ticks = lib.cbserve_overlap
        self._ticks.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self._ticks.restype = ctypes.c_double

    def ticks(self, kind: int, count: int, tdps: int, iters: int) -> float:
        """Ticks an iteration: ``tdps`` (0 or 1) tile products and ``count`` (0, 16, 32, 64) instructions."""
        t = float(self._ticks(kind, count, tdps, iters))
        if t < 0:
            raise ValueError(f"no loop of kind {kind}, count {count}")
        return t


load = BuildOnce(SOURCE, Overlap)
Row = tuple[str, int, float, float]


def hidden(alone: float, tile: float, both: float) -> float:
    """The share of the shorter of ``alone`` and ``tile`` that running them together hides."""
    return (alone + tile - both) / min(alone, tile)


def measure(overlap: Overlap, counts: list[int], rounds: int, iters: int) -> tuple[float, list[Row]]:
    """The tile product's ticks alone, and per kind and count (kind, count, alone, beside a tile product);
    each the best of ``rounds``, the rounds interleaved."""
    best: dict[tuple[int, int, int], float] = {}
    loops = [(0, 0, 1)] + [
        (kind, count, tdps) for kind in range(len(KINDS)) for count in counts for tdps in (0, 1)
    ]
    for _ in range(rounds):
        for loop in loops:
            best[loop] = min(best.get(loop, float("inf")), overlap.ticks(*loop, iters))
    rows = [
        (name, count, best[kind, count, 0], best[kind, count, 1])
        for kind, name in enumerate(KINDS)
        for count in counts
    ]
    return best[0, 0, 1], rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[16, 32, 64], choices=[16, 32, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=200_000)
    args = parser.parse_args(argv)
    try:
        overlap = load()
    except KernelUnavailable as e:
        print(f"cannot measure here: {e}")
        return 1
    tile, rows = measure(overlap, args.counts, args.rounds, args.iters)
    print(f"time stamp counter ticks a loop iteration; a TDPBF16PS alone: {tile:.1f}")
    print("| instruction | count | alone | beside a TDPBF16PS | hidden |")
    print("|---|---|---|---|---|")
    for name, count, alone, both in rows:
        print(f"| {name} | {count} | {alone:.1f} | {both:.1f} | {hidden(alone, tile, both):.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
