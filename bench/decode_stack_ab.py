"""A/B of the decode stack (engine/executor/decode_stack.py) against the layer-by-layer path, interleaved in
one process on one engine, so that a noisy machine's slow minutes hit both sides alike.

    python -m bench.decode_stack_ab [--runs 5] [--prompts 16] [--prompt-len 128] [--new-tokens 64]
                                    [--dtype float32|bfloat16]

Prints, for each side, the best and the median of ``--runs`` whole ``generate_batch`` runs (a prefill of
``--prompts`` random prompts, then greedy decode steps) and of ``3 * --runs`` single decode forwards of all
the prompts at once. The side that goes first alternates.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Callable

import torch

from engine.engine import Engine
from engine.executor.inputs import BatchInputs
from engine.executor.kv_cache import KVCache


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, device="cpu")
    stack = engine.decode_stack
    if stack is None:
        print("this model runs no decode stack here (bfloat16 without AMX, not on the CPU, or no C compiler)")
        return 1
    model = stack.model
    rng = random.Random(0)
    vocab = model.config.vocab_size

    def prompts() -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]

    # one decode step over prompts already in a cache of its own (the engine's belongs to its scheduler)
    cfg, block = model.config, engine.kv_cache.block_size
    pages = -(-(args.prompt_len + 1) // block)
    cache = KVCache(
        cfg.num_hidden_layers,
        1 + args.prompts * pages,
        block,
        cfg.num_key_value_heads,
        cfg.head_dim,
        model.dtype,
    )
    tables = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(args.prompts)]
    ones = [True] * args.prompts
    filled = BatchInputs.build(prompts(), [0] * args.prompts, tables, ones, block)
    step = BatchInputs.build([[7]] * args.prompts, [args.prompt_len] * args.prompts, tables, ones, block)
    model(filled, cache, engine.decode_kernel)

    sides = {"layer by layer": None, "decode stack": stack}  # the engine's runners take it from here
    whole: dict[str, list[float]] = {name: [] for name in sides}
    forward: dict[str, list[float]] = {name: [] for name in sides}
    kwargs = dict(progress_bar=False, max_new_tokens=args.new_tokens, do_sample=False, ignore_eos=True)
    for run in range(args.runs):
        order = list(sides) if run % 2 == 0 else list(sides)[::-1]
        for name in order:
            engine.decode_stack = sides[name]
            run_step: Callable[..., torch.Tensor] = model if sides[name] is None else stack.forward
            whole[name].append(_timed(lambda: engine.generate_batch(prompts(), **kwargs)))
            for _ in range(3):
                forward[name].append(_timed(functools.partial(run_step, step, cache, engine.decode_kernel)))
    engine.decode_stack = stack
    for name in sides:
        w, f = whole[name], forward[name]
        print(
            f"{name:15s} whole run: best {min(w):.3f} s, median {statistics.median(w):.3f} s;"
            f"  {args.prompts}-sequence decode forward: best {1e3 * min(f):.2f} ms, median {1e3 * statistics.median(f):.2f} ms"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
