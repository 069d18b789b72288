"""Beam search throughput: cbserve's beam searches inside its continuous batch against transformers'
``generate(num_beams=...)`` in padded static batches, on the same weights and prompts, in one run.

    python -m bench.beam_search                       # 16 concurrent 4-beam requests, the default model
    python -m bench.beam_search --num-prompts 16 --num-beams 4 --min-new 64 --max-new 128 --device cuda

Every request returns its best beam of exactly its requested length (EOS ignored), so both systems output
the same number of tokens; a static batch runs to its longest request and only the requested tokens count.
Peak memory is what the run adds over the loaded model: on CUDA ``torch.cuda.max_memory_allocated``, on a
CPU the process' resident set sampled every 5 ms (cbserve's KV cache is allocated at load, so its CPU
figure is its working memory; its KV blocks in use at the peak are reported beside it).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.offline import (
    ModelSpec,
    _commit,
    _hf_model,
    _machine,
    _release_memory,
    generate_static,
    make_workload,
    serve_all,
)


@dataclass
class BeamRun:
    system: str
    num_prompts: int
    num_beams: int
    output_tokens: int
    seconds: float
    peak_memory_bytes: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@contextmanager
def peak_memory(device: str) -> Iterator[Callable[[], int]]:
    """The memory the block adds at its peak (read the returned function after the block)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        yield lambda: torch.cuda.max_memory_allocated() - base
        return
    base = _rss_bytes()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.005):
            peak[0] = max(peak[0], _rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield lambda: peak[0] - base
    finally:
        stop.set()
        sampler.join()
        peak[0] = max(peak[0], _rss_bytes())


def run_cbserve(
    work: list[tuple[list[int], int]], spec: ModelSpec, num_beams: int, **options: Any
) -> BeamRun:
    from engine.engine import Engine

    engine = Engine.from_pretrained(
        spec.model, device=spec.device, dtype=spec.dtype, load_format=spec.load_format, **options
    )
    engine.generate_batch(
        [work[0][0][:16]], progress_bar=False, max_new_tokens=4, num_beams=num_beams
    )  # warm-up
    manager = engine.init_continuous_batching(max_queue=len(work) + 1)
    peak_blocks = [0]
    manager.add_step_observer(
        lambda _: peak_blocks.__setitem__(
            0, max(peak_blocks[0], round(manager.stats().kv_cache_usage * engine.num_blocks))
        )
    )
    manager.start()
    with peak_memory(spec.device) as peak:
        start = time.perf_counter()
        total = serve_all(manager, work, num_beams=num_beams)
        seconds = time.perf_counter() - start
    manager.stop()
    label = f"cbserve ({peak_blocks[0]} of {engine.num_blocks} KV blocks of {engine.block_size} at the peak)"
    return BeamRun(label, len(work), num_beams, total, seconds, peak())


def run_hf_static(
    work: list[tuple[list[int], int]], spec: ModelSpec, num_beams: int, batch_size: int, threads: int
) -> BeamRun:
    """Left-padded static batches of ``batch_size`` prompts, each searched with ``num_beams`` beams."""
    model = _hf_model(threads, spec)
    with peak_memory(spec.device) as peak:
        start = time.perf_counter()
        total = generate_static(model, work, batch_size, num_beams=num_beams)
        seconds = time.perf_counter() - start
    label = f"transformers generate (static, batch {batch_size})"
    return BeamRun(label, len(work), num_beams, total, seconds, peak())


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--num-beams", type=int, default=4)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--min-new", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--static-batch-size", type=int, default=16)
    ap.add_argument("--systems", default="cbserve,hf-static")
    ap.add_argument("--save-result", type=Path, default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from engine.loader.model_loader import load_tokenizer

    torch.set_num_threads(args.threads)
    spec = ModelSpec(args.model, args.load_format, args.device, args.dtype)
    vocab = load_tokenizer(args.model).vocab_size
    work = make_workload(
        vocab, args.num_prompts, (args.min_prompt, args.max_prompt), (args.min_new, args.max_new), args.seed
    )
    results: list[BeamRun] = []
    for system in args.systems.split(","):
        if system == "cbserve":
            r = run_cbserve(
                work, spec, args.num_beams, max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks
            )
        elif system == "hf-static":
            r = run_hf_static(work, spec, args.num_beams, args.static_batch_size, args.threads)
        else:
            raise SystemExit(f"unknown system {system!r}")
        results.append(r)
        _release_memory()
        print(
            f"{r.system:60s} {r.output_tokens:6d} tokens {r.seconds:8.1f} s {r.output_tokens_per_s:8.1f} tok/s "
            f"peak +{r.peak_memory_bytes / 2**20:8.1f} MiB",
            flush=True,
        )
    print(
        f"\nworkload: {args.num_prompts} concurrent {args.num_beams}-beam requests, {args.min_prompt}-{args.max_prompt} "
        f"prompt tokens, {args.min_new}-{args.max_new} new tokens, {args.model} in {args.dtype} on {_machine(args.device)}"
    )
    if args.save_result:
        doc = {
            "commit": _commit(),
            "machine": _machine(args.device),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "args": vars(args) | {"save_result": str(args.save_result)},
            "results": [asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in results],
        }
        args.save_result.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
