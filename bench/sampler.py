"""The sampler's step on the CPU, with its C pass for each row's maximum and argmax
(engine/generation/row_argmax.py) and with the PyTorch path it replaces, interleaved in one process.

    python -m bench.sampler [--rows 1 16 32] [--vocab 49152] [--rounds 400] [--logprobs]

Times ``Sampler.sample`` on ``rows`` greedy rows of ``vocab`` random logits (bfloat16 widened to float32 in
the timed call, as the model's head hands them over), the two sides alternating which goes first each
round; prints the median and best microseconds of each and whether they chose the same tokens.
``--logprobs``: the rows ask for their logprobs (top 5) too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.generation.config import GenerationConfig
from engine.generation.rng import RequestRNG
from engine.generation.rows import SampledToken, SamplingRow
from engine.generation.sampler import Sampler


def timed_sample(
    sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[float, list[SampledToken]]:
    start = time.perf_counter()
    tokens = sampler.sample(logits.float(), rows)
    return time.perf_counter() - start, tokens


def compare(num_rows: int, vocab: int, rounds: int, logprobs: bool) -> str:
    """One line: both sides' median and best time of a step of ``num_rows`` greedy rows."""
    gen = torch.Generator().manual_seed(num_rows)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 3).bfloat16()
    config = GenerationConfig(do_sample=False, output_logprobs=logprobs, top_logprobs=5 if logprobs else 0)
    rows = [SamplingRow(config, [1, 2, 3], [], RequestRNG(None, i)) for i in range(num_rows)]
    sides = {"C pass": Sampler(vocab), "PyTorch": Sampler(vocab, row_argmax=False)}
    if not sides["C pass"].has_row_argmax:
        return f"rows {num_rows}: no C compiler here, the sampler runs its PyTorch path only"
    times: dict[str, list[float]] = {name: [] for name in sides}
    chosen: dict[str, list[SampledToken]] = {}
    for r in range(rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            elapsed, chosen[name] = timed_sample(sides[name], logits, rows)
            times[name].append(elapsed)
    same = "same tokens" if chosen["C pass"] == chosen["PyTorch"] else "TOKENS DIFFER"
    cells = [
        f"{n} median {1e6 * statistics.median(t):7.1f} us best {1e6 * min(t):7.1f} us"
        for n, t in times.items()
    ]
    return f"rows {num_rows:3d}: " + " | ".join(cells) + f" | {same}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--logprobs", action="store_true")
    args = parser.parse_args(argv)
    for num_rows in args.rows:
        print(compare(num_rows, args.vocab, args.rounds, args.logprobs), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
