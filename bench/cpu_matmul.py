"""CPU float32 matmul throughput for one decoder layer's projections: oneDNN's prepacked kernels (what
prefill runs), cbserve's small-batch kernel (what decode steps run, engine/executor/kernels/small_gemm.py) and
``F.linear`` (MKL), at several row counts, interleaved and best of several rounds (robust to a noisy VM).

    python -m bench.cpu_matmul                 # SmolLM2-135M's shapes, rows 16 64 256 2048
    python -m bench.cpu_matmul --rows 16 2048 --hidden 576 --intermediate 1536 --q-heads 9 --kv-heads 3

Prints each system's time for the layer's four matmuls (q/k/v fused, o, gate/up fused, down) and GFLOPS.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.executor.kernels import prepacked, small_gemm


def layer_shapes(hidden: int, intermediate: int, q_heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """(in_features, out_features) of one layer's fused projections."""
    head_dim = hidden // q_heads
    return [
        (hidden, (q_heads + 2 * kv_heads) * head_dim),  # qkv
        (q_heads * head_dim, hidden),  # o
        (hidden, 2 * intermediate),  # gate_up
        (intermediate, hidden),  # down
    ]


def best_seconds(fns: dict[str, Callable[[], object]], reps: int, rounds: int) -> dict[str, float]:
    """Each function's best mean time over ``rounds`` rounds of ``reps`` calls, the systems interleaved."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / reps)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 2048])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    cpu = torch.device("cpu")
    if not prepacked.can_prepack(cpu, torch.float32):
        raise SystemExit("this torch build cannot prepack float32 weights (no oneDNN)")
    kernel = small_gemm.load()
    gen = torch.Generator().manual_seed(0)
    shapes = layer_shapes(args.hidden, args.intermediate, args.q_heads, args.kv_heads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; shapes (in, out): {shapes}")
    for m in args.rows:
        totals: dict[str, float] = {}
        flops = 0
        for k, n in shapes:
            w = torch.randn(n, k, generator=gen) * 0.05
            x = torch.randn(m, k, generator=gen)
            packed, panels = prepacked.prepack(w), kernel.pack(w)
            ref = F.linear(x, w)
            torch.testing.assert_close(kernel.linear(x, panels, n, None), ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(prepacked.linear(x, packed, None), ref, rtol=1e-4, atol=1e-4)
            fns: dict[str, Callable[[], object]] = {
                "oneDNN": functools.partial(prepacked.linear, x, packed, None),
                "small-kernel": functools.partial(kernel.linear, x, panels, n, None),
                "F.linear": functools.partial(F.linear, x, w),
            }
            reps = max(2, int(3e8 / (m * k * n)))
            for name, seconds in best_seconds(fns, reps, args.rounds).items():
                totals[name] = totals.get(name, 0.0) + seconds
            flops += 2 * m * k * n
        cells = "  ".join(f"{name} {t * 1e3:8.2f} ms ({flops / t / 1e9:5.1f} GFLOPS)" for name, t in totals.items())
        print(f"rows {m:5d}: {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
