"""CPU matmul throughput for one decoder layer's projections, at several row counts, interleaved and best
of several rounds (robust to a noisy VM). float32: oneDNN's prepacked kernels (what prefill runs on AVX-512),
cbserve's small-batch kernel (engine/executor/kernels/small_gemm.py) and ``F.linear`` (MKL). bfloat16:
oneDNN's prepacked kernels, cbserve's AMX kernel (engine/executor/kernels/amx_gemm.py, where the CPU has
AMX, else its AVX512-BF16 kernel, bf16_gemm.py) and ``F.linear``.

    python -m bench.cpu_matmul                 # SmolLM2-135M's shapes, rows 16 64 256 2048
    python -m bench.cpu_matmul --dtype bfloat16 --rows 1 16 64 2048
    python -m bench.cpu_matmul --rows 16 2048 --hidden 576 --intermediate 1536 --q-heads 9 --kv-heads 3
    python -m bench.cpu_matmul --dtype bfloat16 --rows 1 12 16 24 --layers 30

Prints each system's time for the layer's four matmuls (q/k/v fused, o, gate/up fused, down) and GFLOPS.
With ``--layers N`` the four matmuls of N layers, each layer's weights its own: as in a decode step, every
call reads its weights from memory instead of a cache the previous call warmed, so a few rows show the
memory floor (the bytes read per second are printed too) and more show what their dot products add.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from engine.cpu.native_build import KernelUnavailable
from engine.executor.kernels import amx_gemm, bf16_gemm, prepacked, small_gemm


def layer_shapes(hidden: int, intermediate: int, q_heads: int, kv_heads: int) -> list[tuple[int, int]]:
    """(in_features, out_features) of one layer's fused projections."""
    head_dim = hidden // q_heads
    return [
        (hidden, (q_heads + 2 * kv_heads) * head_dim),  # qkv
        (q_heads * head_dim, hidden),  # o
        (hidden, 2 * intermediate),  # gate_up
        (intermediate, hidden),  # down
    ]


def best_seconds(fns: Mapping[str, Callable[[], object]], reps: int, rounds: int) -> dict[str, float]:
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


Kernel = small_gemm.SmallGemm | amx_gemm.AmxGemm | bf16_gemm.Bf16Gemm


def own_kernel(dtype: torch.dtype) -> tuple[str, Kernel]:
    """cbserve's kernel for ``dtype`` and its name: the small float32 kernel; for bfloat16 the AMX kernel,
    else the AVX512-BF16 one (engine/executor/fast_paths.py's choice)."""
    try:
        if dtype == torch.float32:
            return "small-kernel", small_gemm.load()
        try:
            return "amx-kernel", amx_gemm.load()
        except KernelUnavailable:
            return "bf16-dot-kernel", bf16_gemm.load()
    except KernelUnavailable as e:
        raise SystemExit(f"cbserve's {dtype} kernel is not available here: {e}") from e


def systems(
    x: torch.Tensor, w: torch.Tensor, ours_name: str, ours: Kernel
) -> dict[str, Callable[[], torch.Tensor]]:
    """The systems' ``x w^T`` (weights packed for each), checked against a float64 reference first."""
    n = w.shape[0]
    packed, panels = prepacked.prepack(w), ours.pack(w)
    fns: dict[str, Callable[[], torch.Tensor]] = {
        "oneDNN": functools.partial(prepacked.linear, x, packed, None),
        ours_name: functools.partial(ours.linear, x, panels, n, None),
        "F.linear": functools.partial(F.linear, x, w),
    }
    ref = F.linear(x.double(), w.double()).to(w.dtype)
    tol = 1e-4 if w.dtype == torch.float32 else 2e-2
    for fn in fns.values():
        torch.testing.assert_close(fn(), ref, rtol=tol, atol=tol)
    return fns


def in_sequence(calls: list[Callable[[], object]]) -> Callable[[], None]:
    def run() -> None:
        for call in calls:
            call()

    return run


def time_rows(
    m: int, shapes: list[tuple[int, int]], args: argparse.Namespace, ours: tuple[str, Kernel]
) -> str:
    """One row count's line: each system's time for ``args.layers`` layers' matmuls (one layer: its
    matmuls each timed alone, repeated; more: every layer's in a row, each layer's weights its own)."""
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    per_layer = []
    for _ in range(args.layers):
        per_layer.append(
            [
                systems(
                    torch.randn(m, k, generator=gen).to(dtype),
                    (torch.randn(n, k, generator=gen) * 0.05).to(dtype),
                    *ours,
                )
                for k, n in shapes
            ]
        )
    flops = 2 * m * sum(k * n for k, n in shapes) * args.layers
    weight_bytes = sum(k * n for k, n in shapes) * args.layers * torch.finfo(dtype).bits // 8
    totals: dict[str, float] = {}
    if args.layers == 1:
        for fns, (k, n) in zip(per_layer[0], shapes, strict=True):
            reps = max(2, int(args.work / (m * k * n)))
            for name, seconds in best_seconds(fns, reps, args.rounds).items():
                totals[name] = totals.get(name, 0.0) + seconds
    else:
        names = list(per_layer[0][0])
        steps = {name: in_sequence([fns[name] for layer in per_layer for fns in layer]) for name in names}
        totals = best_seconds(steps, 1, args.rounds)
    cells = "  ".join(
        f"{name} {t * 1e3:8.2f} ms ({flops / t / 1e9:5.1f} GFLOPS"
        + (f", {weight_bytes / t / 1e9:5.1f} GB/s)" if args.layers > 1 else ")")
        for name, t in totals.items()
    )
    return f"rows {m:5d}: {cells}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256, 2048])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--work", type=float, default=3e8, help="multiply-adds each timing repeats a call to")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--layers", type=int, default=1, help="layers of weights of their own, read in a row")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if not prepacked.can_prepack(torch.device("cpu"), dtype):
        raise SystemExit(f"this torch build or CPU cannot prepack {args.dtype} weights (no oneDNN)")
    ours = own_kernel(dtype)
    shapes = layer_shapes(args.hidden, args.intermediate, args.q_heads, args.kv_heads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; shapes (in, out): {shapes}")
    if args.layers > 1:
        print(f"{args.layers} layers of weights of their own, read in a row (as a decode step reads them)")
    for m in args.rows:
        print(time_rows(m, shapes, args, ours), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
