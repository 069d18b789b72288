"""Tensor parallelism's per-step cost on this CPU: the same model served by one process and by
``--tensor-parallel-size`` ranks (gloo), greedy, in one run.

    python -m bench.tensor_parallel [--tensor-parallel-size 2] [--prompts 8] [--prompt-len 64]
                                    [--new-tokens 32] [--runs 3] [--model M --load-format F]

The default model is a random one shaped like SmolLM2-135M but with 8 heads over 4 KV heads (SmolLM2's
9 over 3 do not split in two). For each side: the best of ``--runs`` ``generate_batch`` runs, as
milliseconds per engine step (a prefill step, then decode steps of ``--prompts`` rows). One process runs
without the C decode stack too, as the ranks do (it has no collectives between its layers; the prepacked
matmuls and fused ops run on every rank), so that ``sharded - one / N`` bounds what the step's collectives
and its broadcast cost (on a machine whose ranks each have a socket, and its memory bandwidth, a step
costs about ``one / N`` plus that).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from engine.engine import Engine
from engine.loader.dummy import get_preset
from engine.loader.model_loader import load_tokenizer

SHAPE = {"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 512, "head_dim": 64}


def _default_model(folder: Path) -> str:
    config = get_preset("smollm2-135m").replace(**SHAPE)
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    load_tokenizer("default").save(folder)
    return str(folder)


def _ms_per_step(engine: Engine, prompts: list[list[int]], new_tokens: int, runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        manager_steps = 1 + new_tokens  # one prefill step (the token budget holds every prompt), then decodes
        start = time.perf_counter()
        engine.generate_batch(
            prompts, progress_bar=False, max_new_tokens=new_tokens, ignore_eos=True, do_sample=False
        )
        best = min(best, (time.perf_counter() - start) * 1000 / manager_steps)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or _default_model(Path(tmp))
        common = {"load_format": args.load_format, "device": "cpu", "dtype": "float32"}
        sides = {
            "one process": {},
            "one process, no decode stack": {},
            f"{args.tensor_parallel_size} ranks": {"tensor_parallel_size": args.tensor_parallel_size},
        }
        results: dict[str, float] = {}
        for name, options in sides.items():
            engine = Engine.from_pretrained(model, **common, **options)  # type: ignore[arg-type]
            if name.endswith("no decode stack"):
                engine.decode_stack = None  # read by the managers it makes
            try:
                rng = random.Random(0)  # the same prompts on every side
                vocab = engine.vocab_size
                prompts = [
                    [rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)
                ]
                results[name] = _ms_per_step(engine, prompts, args.new_tokens, args.runs)
            finally:
                engine.close()
            print(f"{name:>28}: {results[name]:8.2f} ms/step")
    plain, sharded = results["one process, no decode stack"], results[f"{args.tensor_parallel_size} ranks"]
    overhead = sharded - plain / args.tensor_parallel_size
    print(
        f"collectives + broadcast, at most: {overhead:.2f} ms/step ({overhead / sharded:.0%} of a sharded step)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
