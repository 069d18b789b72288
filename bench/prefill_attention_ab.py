"""A/B of prefill attention on the CPU: the prefill kernel (engine/executor/attention/csrc/paged_prefill.c) against
one SDPA call per sequence, interleaved in one process on one engine, so that a noisy machine's slow
minutes hit both sides alike.

    python -m bench.prefill_attention_ab [--runs 6] [--prompts 16] [--prompt-len 128] [--dtype bfloat16]

Each run prefills ``--prompts`` random prompts in one step (``generate_batch`` with one new token) with the
kernel switched on or off; the side that goes first alternates. In bfloat16 on a CPU with AMX or AVX512-BF16
the kernel runs its items on AMX tiles or dot products (csrc/paged_prefill_bf16.c: each kind the CPU has is a
side, "kernel, tiles" and "kernel, dots"), and a further side runs them on its float32 vector path. Prints, for
each side, the best and the median of the whole step and of the time spent in the model's attention calls
(K/V writes included).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.engine import Engine
from engine.executor.attention import paged
from engine.executor.attention.decode_kernel import PrefillKernel
from engine.executor.models import llama
from engine.outputs import RequestStatus


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, device="cpu")
    kernel = engine.decode_kernel
    if not isinstance(kernel, PrefillKernel):
        print("no CPU prefill kernel here (no C compiler, or a shape it does not take)")
        return 1
    rng = random.Random(0)
    vocab = engine.model.config.vocab_size

    kernel_part = paged._prefill_part
    kinds = list(getattr(kernel, "prefill_kinds", [])) if args.dtype == "bfloat16" else []
    # side: (the prefill part's function, the products of the kernel's bfloat16 items: None for its vector path)
    sides: dict[str, tuple[Callable[..., Any], str | None]] = {
        "sdpa per sequence": (lambda *args: None, None)
    }
    for kind in kinds:
        sides[f"kernel, {kind}"] = (kernel_part, kind)
    sides["kernel, vectors" if kinds else "prefill kernel"] = (kernel_part, None)
    attention_s = [0.0]
    real_attention = llama.paged_attention

    def timed_attention(*a: Any, **k: Any) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return real_attention(*a, **k)
        finally:
            attention_s[0] += time.perf_counter() - start

    step: dict[str, list[float]] = {name: [] for name in sides}
    attention: dict[str, list[float]] = {name: [] for name in sides}
    kwargs = dict(progress_bar=False, max_new_tokens=1, do_sample=False, ignore_eos=True)
    llama.paged_attention = timed_attention  # type: ignore[assignment]
    try:
        for run in range(args.runs):
            for name in list(sides) if run % 2 == 0 else list(sides)[::-1]:
                paged._prefill_part, kind = sides[name]  # type: ignore[assignment]
                if kinds:
                    kernel.bf16_prefill = kind  # type: ignore[attr-defined]
                prompts = [
                    [rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)
                ]
                attention_s[0] = 0.0
                start = time.perf_counter()
                results = engine.generate_batch(prompts, **kwargs)
                failed = [out.error for out in results.values() if out.status is not RequestStatus.FINISHED]
                if failed:
                    raise RuntimeError(f"{name}: a prefill failed: {failed[0]}")
                step[name].append(time.perf_counter() - start)
                attention[name].append(attention_s[0])
    finally:
        paged._prefill_part = kernel_part  # type: ignore[assignment]
        if kinds:
            kernel.bf16_prefill = kinds[0]  # type: ignore[attr-defined]
        llama.paged_attention = real_attention  # type: ignore[assignment]
    _report(step, attention, f"{args.prompts} x {args.prompt_len}")
    return 0


def _report(step: dict[str, list[float]], attention: dict[str, list[float]], shape: str) -> None:
    """Each side's whole prefill step and its attention's share: best and median of the runs."""
    for name in step:
        s, a = step[name], attention[name]
        print(
            f"{name:17s} prefill of {shape}: best {min(s):.3f} s, median "
            f"{statistics.median(s):.3f} s;  attention: best {1e3 * min(a):.1f} ms, median "
            f"{1e3 * statistics.median(a):.1f} ms"
        )


if __name__ == "__main__":
    raise SystemExit(main())
