"""Where a CPU decode step's time goes: the decode stack's phases (engine/executor/kernels/csrc/decode_stack.c
built with its phase marks on: bench/csrc/decode_stack_phases.c), summed over the layers, per step, over
whole ``generate_batch`` runs of a model.

    python -m bench.decode_phases [--dtype bfloat16] [--prompts 16] [--prompt-len 128] [--new-tokens 256]
                                  [--runs 2] [--model default]

Prints each phase's time a step and its share of the stack's (the first thread's time stamp counter, its
rate measured against the clock over the runs): the norms, the qkv projection, the rotary embedding and the
K/V writes, the attention, the o projection, the gate and up projection, the gate, the down projection. Each
phase ends in the threads' barrier, so its time is the step's time in it, imbalance included. The rest of a
decode step -- the embedding, the output head, sampling and the engine's Python -- is outside the stack:
the last lines give a decode step's forward (the embedding, the stack and the head, timed around
``CpuDecodeStack.run``) and the whole runs' time a decode step (prefill steps included, so an upper bound).
The engine's own build of the stack has no marks (its code is unchanged by them).
"""

from __future__ import annotations

import argparse
import ctypes
import random
import time
from pathlib import Path

import torch

from engine.cpu.native_build import BuildOnce, KernelUnavailable
from engine.engine import Engine
from engine.executor import decode_stack

PHASES_SOURCE = Path(__file__).parent / "csrc" / "decode_stack_phases.c"
# in the order of decode_stack.c's PHASE_* marks
PHASES = ("norm", "qkv", "rotary + K/V", "attention", "o", "post-attention norm", "gate/up", "gate", "down")


def _counters(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.cbserve_decode_stack_phases.argtypes = [ctypes.POINTER(ctypes.c_double)]
    lib.cbserve_decode_stack_phases.restype = ctypes.c_int64
    lib.cbserve_ticks.restype = ctypes.c_uint64
    return lib


def _read(lib: ctypes.CDLL) -> tuple[list[float], int]:
    ticks = (ctypes.c_double * len(PHASES))()
    steps = int(lib.cbserve_decode_stack_phases(ticks))
    return list(ticks), steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args(argv)

    # the engine's decode stack from the marked build (CpuDecodeStack.for_model calls decode_stack.load)
    decode_stack.load = BuildOnce(PHASES_SOURCE, decode_stack.DecodeStack)
    try:
        lib = _counters(decode_stack.load().path)  # the same library the engine's stack calls
    except KernelUnavailable as e:
        print(f"the decode stack cannot be built here: {e}")
        return 1
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, device="cpu")
    rng = random.Random(0)
    vocab = engine.vocab_size

    def prompts() -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]

    stack_runs = _timed_runs(engine)

    def generate(new_tokens: int) -> None:
        engine.generate_batch(
            prompts(), max_new_tokens=new_tokens, progress_bar=False, do_sample=False, ignore_eos=True
        )

    generate(4)  # warm-up: the builds, the first steps
    lib.cbserve_decode_stack_phases_reset()
    stack_runs.clear()
    start, ticks0 = time.perf_counter(), lib.cbserve_ticks()
    for _ in range(args.runs):
        generate(args.new_tokens)
    seconds = time.perf_counter() - start
    rate = (lib.cbserve_ticks() - ticks0) / seconds  # time stamp counter ticks a second
    ticks, steps = _read(lib)
    if steps == 0:
        print("no decode step ran in the decode stack (the model or the CPU does not take it)")
        return 1
    print(
        f"{steps} decode steps of {args.prompts} sequences ({args.dtype}), the counter at {rate / 1e9:.2f} GHz"
    )
    _report(ticks, steps, rate)
    in_run = sum(stack_runs) / len(stack_runs) * 1e3
    print(f"a decode step's forward (the embedding, the stack, the output head): {in_run:.2f} ms")
    print(
        f"whole runs: {seconds / steps * 1e3:.2f} ms a decode step (prefill steps, sampling and Python included)"
    )
    return 0


def _report(ticks: list[float], steps: int, rate: float) -> None:
    """Each phase's time a step and share of the stack's, as a table."""
    stack = sum(ticks)
    print("| phase | ms a step | share of the stack |")
    print("|---|---|---|")
    for name, t in zip(PHASES, ticks, strict=True):
        print(f"| {name} | {t / steps / rate * 1e3:.2f} | {t / stack:.1%} |")
    print(f"| the stack | {stack / steps / rate * 1e3:.2f} | 100% |")


def _timed_runs(engine: Engine) -> list[float]:
    """The seconds of each of the engine's decode stack forwards (``CpuDecodeStack.run``), appended as they go."""
    stack = engine.decode_stack
    if stack is None:
        raise SystemExit("this engine has no decode stack (the model or the CPU does not take it)")
    seconds: list[float] = []
    run = stack.run

    def timed(*args: object, **kwargs: object) -> torch.Tensor:
        start = time.perf_counter()
        out = run(*args, **kwargs)  # type: ignore[arg-type]
        seconds.append(time.perf_counter() - start)
        return out

    stack.run = timed  # type: ignore[method-assign]
    return seconds


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
