"""The GPU decode-attention kernel (engine/executor/attention/triton_decode.py) against PyTorch SDPA over gathered
pages (the ``sdpa`` backend) on Llama-3-8B's attention shapes, and its launch parameters swept.

    python -m bench.triton_decode_tune                 # needs CUDA and Triton
    python -m bench.triton_decode_tune --quick         # the kernel's defaults and SDPA only

Every case is one layer's decode attention of ``num_seqs`` sequences of ``context`` tokens, pages scattered
at random, the block tables as wide as the CUDA graphs make them (``--max-model-len``). Each timing is the
median of ``triton.testing.do_bench``; each configuration's output is checked against the SDPA path first.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch

CASES = [(1, 4096), (8, 2048), (64, 576), (64, 2048), (256, 576)]  # (num_seqs, context)


def _case(num_seqs: int, context: int, width: int, heads: int, kv_heads: int, head_dim: int, block_size: int):
    from engine.executor.attention.paged import DecodePart

    gen = torch.Generator(device="cuda").manual_seed(num_seqs * 7919 + context)
    pages = -(-context // block_size)
    num_blocks = num_seqs * pages + 1
    k_cache = torch.randn(num_blocks, kv_heads, head_dim, block_size, device="cuda", generator=gen).bfloat16()
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, device="cuda", generator=gen).bfloat16()
    order = torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1
    tables = torch.zeros(num_seqs, width, dtype=torch.int64, device="cuda")
    tables[:, :pages] = order[: num_seqs * pages].view(num_seqs, pages)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int64, device="cuda")
    q = torch.randn(num_seqs, heads, head_dim, device="cuda", generator=gen).bfloat16()
    key_pos = torch.arange(pages * block_size, device="cuda")
    bias = torch.zeros(num_seqs, 1, 1, pages * block_size, device="cuda", dtype=torch.bfloat16)
    bias.masked_fill_(key_pos >= context, float("-inf"))
    part = DecodePart(tables[:, :pages], seq_lens, bias, 0, num_seqs)
    return q, k_cache, v_cache, tables, seq_lens, part


def _launch_grid(quick: bool) -> list[dict[str, Any]]:
    """The launch settings to try: the kernel's defaults first, then (unless ``quick``) the whole sweep."""
    from engine.executor.attention.triton_decode import TritonDecodeKernel

    default = TritonDecodeKernel()
    grid: list[dict[str, Any]] = [
        {
            "programs_per_sm": d.programs_per_sm,
            "block_n": d.block_n,
            "num_warps": d.num_warps,
            "num_stages": d.num_stages,
        }
        for d in (default,)
    ]
    if not quick:
        for pps, bn, nw, ns in itertools.product((1, 2, 4, 8, 16), (32, 64, 128), (2, 4, 8), (None, 2)):
            cfg = {"programs_per_sm": pps, "block_n": bn, "num_warps": nw, "num_stages": ns}
            if cfg not in grid:
                grid.append(cfg)
    return grid


def _print_ranking(results: dict[str, dict[str, float]], sdpa_ms: dict[str, float]) -> None:
    """The five settings with the best geometric-mean time against SDPA over every case."""
    complete = {c: r for c, r in results.items() if len(r) == len(CASES)}
    ranked = sorted(
        complete, key=lambda c: statistics.geometric_mean(complete[c][n] / sdpa_ms[n] for n in sdpa_ms)
    )
    for c in ranked[:5]:
        rel = statistics.geometric_mean(complete[c][n] / sdpa_ms[n] for n in sdpa_ms)
        print(
            f"geomean time / SDPA {rel:.3f}: {c} " + " ".join(f"{complete[c][n] * 1e3:.0f}" for n in sdpa_ms)
        )


def main(argv: list[str] | None = None) -> int:
    import triton.testing

    from engine.executor.attention.paged import _decode_attention
    from engine.executor.attention.triton_decode import TritonDecodeKernel

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--save-result", type=Path, default=None)
    args = ap.parse_args(argv)
    heads, kv_heads, head_dim = 32, 8, 128
    width = -(-args.max_model_len // args.block_size)
    scale = head_dim**-0.5
    grid = _launch_grid(args.quick)
    results: dict[str, dict[str, float]] = {}
    sdpa_ms: dict[str, float] = {}
    for num_seqs, context in CASES:
        name = f"{num_seqs}x{context}"
        q, k_cache, v_cache, tables, seq_lens, part = _case(
            num_seqs, context, width, heads, kv_heads, head_dim, args.block_size
        )
        sdpa = functools.partial(_decode_attention, q, k_cache, v_cache, part, heads // kv_heads, scale)
        ref = sdpa()
        sdpa_ms[name] = triton.testing.do_bench(sdpa, return_mode="median")
        kv_bytes = num_seqs * context * kv_heads * head_dim * 2 * 2
        for cfg in grid:
            kernel = TritonDecodeKernel()
            for key, value in cfg.items():
                setattr(kernel, key, value)
            run = functools.partial(kernel, q, k_cache, v_cache, tables, seq_lens, scale, None)
            out = run()
            err = (out.float() - ref.float()).abs().max().item()
            if not math.isfinite(err) or err > 3e-2:
                print(f"{name} {cfg}: WRONG (max error {err})")
                continue
            ms = triton.testing.do_bench(run, return_mode="median")
            results.setdefault(json.dumps(cfg), {})[name] = ms
        best = sorted((r[name], c) for c, r in results.items() if name in r)[:3]
        base = results[json.dumps(grid[0])][name]
        print(
            f"{name:>9}: SDPA {sdpa_ms[name] * 1e3:7.1f} us | default {base * 1e3:7.1f} us "
            f"({kv_bytes / (base * 1e-3) / 1e9:6.0f} GB/s, {sdpa_ms[name] / base:4.1f}x SDPA) | best "
            + "; ".join(f"{ms * 1e3:.1f} us {c}" for ms, c in best),
            flush=True,
        )
    _print_ranking(results, sdpa_ms)
    if args.save_result:
        args.save_result.write_text(json.dumps({"sdpa_ms": sdpa_ms, "kernel_ms": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
