"""Offline throughput: cbserve's ``generate_batch`` against transformers' continuous batching and padded
static ``generate`` on the same weights, the same prompts and the same output lengths, in one run.

    python -m bench.offline --num-prompts 64 --min-prompt 16 --max-prompt 512 --min-new 64 --max-new 256
    python -m bench.offline --model llama-3-8b --load-format dummy --device cuda --dtype bfloat16 \
        --num-prompts 256 --max-num-seqs 256 --kv-cache-memory 40GiB --systems cbserve,hf-cb

Every system generates exactly the requested number of tokens for every prompt (EOS ignored), greedy, so
the output token counts are equal and the tokens/s compare like for like. The transformers peers load the
very weights cbserve loads (``engine.loader.model_loader.open_source``: the GGUF dequantized, a Hugging Face
folder, or the same seeded dummy weights). transformers is a test-only dependency: install the project's
``test`` extra to run the peers.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from server.config import parse_bytes


@dataclass
class RunResult:
    system: str
    num_prompts: int
    prompt_tokens: int
    output_tokens: int
    seconds: float

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def make_workload(
    vocab_size: int, num_prompts: int, prompt_range: tuple[int, int], new_range: tuple[int, int], seed: int
) -> list[tuple[list[int], int]]:
    """Random token prompts (ids 100..vocab-1, clear of the special tokens) with random output lengths."""
    rng = random.Random(seed)
    work = []
    for _ in range(num_prompts):
        n = rng.randint(*prompt_range)
        prompt = [rng.randrange(100, vocab_size) for _ in range(n)]
        work.append((prompt, rng.randint(*new_range)))
    return work


@dataclass(frozen=True)
class ModelSpec:
    """What every system loads: ``Engine.from_pretrained``'s model, load format, device and dtype."""

    model: str = "default"
    load_format: str = "auto"
    device: str = "cpu"
    dtype: str = "float32"


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_cbserve(
    work: list[tuple[list[int], int]], threads: int, spec: ModelSpec, **options: Any
) -> RunResult:
    from engine.engine import Engine
    from engine.executor.models.transformers_backend import TransformersForCausalLM

    torch.set_num_threads(threads)
    engine = Engine.from_pretrained(
        spec.model, device=spec.device, dtype=spec.dtype, load_format=spec.load_format, **options
    )
    graphs = ", CUDA graphs" if engine.cuda_graphs is not None else ""
    impl = ", transformers backend" if isinstance(engine.model, TransformersForCausalLM) else ""
    label = f"cbserve generate_batch ({engine.attention_backend} decode attention{graphs}{impl})"
    # warm-up: one short request, so that lazy initialisation is not timed
    engine.generate_batch([work[0][0][:16]], progress_bar=False, max_new_tokens=4, do_sample=False)
    manager = engine.init_continuous_batching(max_queue=len(work) + 1)
    manager.start()
    start = time.perf_counter()
    total = serve_all(manager, work)
    seconds = time.perf_counter() - start
    manager.stop()
    return RunResult(label, len(work), sum(len(p) for p, _ in work), total, seconds)


def serve_all(manager: Any, work: list[tuple[list[int], int]], **options: Any) -> int:
    """Every ``(prompt, max_new_tokens)`` of ``work`` added to a started manager at once (greedy, EOS
    ignored, ``options`` on top), then its results drained: the output tokens they made."""
    for i, (prompt, n) in enumerate(work):
        manager.add_request(
            prompt, request_id=f"r{i}", max_new_tokens=n, do_sample=False, ignore_eos=True, **options
        )
    total = done = 0
    while done < len(work):
        out = manager.get_result(timeout=5.0)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("cbserve's engine stopped")
            continue
        if out.is_finished:
            done += 1
            total += len(out.generated_ids)
    return total


def _hf_model(threads: int, spec: ModelSpec) -> Any:
    """transformers' own model class for the config cbserve reads, holding the weights cbserve loads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.loader.model_loader import open_source, resolve_device, resolve_dtype
    from engine.loader.source import resolve_model

    torch.set_num_threads(threads)
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    opened = open_source(resolve_model(spec.model, spec.load_format), dtype, device)
    hf_config = opened.config.to_hf_dict()
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config), dtype=dtype)
    missing, unexpected = model.load_state_dict(dict(opened.weights), strict=False)
    # NOTE: a tied head is the embedding itself: the source yields no lm_head.weight for it
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"transformers' model does not take these weights: {missing=} {unexpected=}")
    return model.eval()


def run_hf_continuous(work: list[tuple[list[int], int]], threads: int, spec: ModelSpec) -> RunResult:
    from transformers import GenerationConfig

    model = _hf_model(threads, spec)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in work), eos_token_id=-1)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        # warm-up, as for cbserve: one short request, so that lazy initialisation is not timed
        manager.add_request(work[0][0][:16], request_id="warm-up", max_new_tokens=4, eos_token_id=-1)
        while (out := manager.get_result(timeout=60.0)) is None or not out.is_finished():
            if out is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped")
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(work):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        total = 0
        done = 0
        while done < len(work):
            out = manager.get_result(timeout=5.0)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped")
                continue
            if out.is_finished():
                done += 1
                total += len(out.generated_tokens)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
    return RunResult(
        "transformers generate_batch (CB)", len(work), sum(len(p) for p, _ in work), total, seconds
    )


def generate_static(model: Any, work: list[tuple[list[int], int]], batch_size: int, **search: Any) -> int:
    """``model.generate`` over left-padded static batches of ``batch_size`` prompts, each batch run to its
    longest requested length (greedy, or ``search``'s options such as ``num_beams``); returns the requested
    tokens, the output that counts."""
    device = model.device
    total = 0
    for b in range(0, len(work), batch_size):
        chunk = work[b : b + batch_size]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, (p, _) in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        longest = max(n for _, n in chunk)
        with torch.inference_mode():
            model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=0,
                **search,
            )
        total += sum(n for _, n in chunk)
    _synchronize(str(device))
    return total


def run_hf_static(
    work: list[tuple[list[int], int]], threads: int, spec: ModelSpec, batch_size: int
) -> RunResult:
    """Padded static batches (left padding), each batch runs to its longest requested length; only the
    requested tokens count as output."""
    model = _hf_model(threads, spec)
    start = time.perf_counter()
    total = generate_static(model, work, batch_size)
    seconds = time.perf_counter() - start
    return RunResult(f"transformers generate (static, batch {batch_size})", len(work), 0, total, seconds)


def _release_memory() -> None:
    """Give the last system's weights and cache back before the next one loads (one GPU holds one)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _machine(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    return f"{platform.machine()} {platform.processor()}, {torch.get_num_threads()} threads"


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="default", help="what Engine.from_pretrained takes (a dummy preset too)"
    )
    ap.add_argument("--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-new", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=4 << 30,
        help="cbserve's KV cache: bytes or 4GiB, 512MB...",
    )
    ap.add_argument("--static-batch-size", type=int, default=16)
    ap.add_argument("--attention-backend", choices=["auto", "cpu", "triton", "sdpa"], default="auto")
    ap.add_argument("--model-impl", choices=["auto", "native", "transformers"], default="auto")
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: no graphs of cbserve's decode step")
    ap.add_argument(
        "--systems", default="cbserve,hf-cb,hf-static", help="comma-separated: cbserve, hf-cb, hf-static"
    )
    ap.add_argument("--save-result", type=Path, default=None)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)

    from engine.loader.model_loader import load_tokenizer

    spec = ModelSpec(args.model, args.load_format, args.device, args.dtype)
    vocab = load_tokenizer(args.model).vocab_size
    work = make_workload(
        vocab, args.num_prompts, (args.min_prompt, args.max_prompt), (args.min_new, args.max_new), args.seed
    )
    results: list[RunResult] = []
    for system in args.systems.split(","):
        if system not in ("cbserve", "hf-cb", "hf-static"):
            ap.error(f"unknown system {system!r}")
        r = _run(system, work, spec, args)
        results.append(r)
        _release_memory()
        print(
            f"{r.system:45s} {r.output_tokens:7d} tokens  {r.seconds:8.1f} s  {r.output_tokens_per_s:8.1f} tok/s",
            flush=True,
        )
    _report(results, args)
    return 0


def _run(system: str, work: Any, spec: ModelSpec, args: argparse.Namespace) -> RunResult:
    """One system's run of the workload."""
    if system == "cbserve":
        return run_cbserve(
            work,
            args.threads,
            spec,
            max_num_seqs=args.max_num_seqs,
            max_batch_tokens=args.max_batch_tokens,
            kv_cache_memory=args.kv_cache_memory,
            attention_backend=args.attention_backend,
            model_impl=args.model_impl,
            enforce_eager=args.enforce_eager,
        )
    if system == "hf-cb":
        return run_hf_continuous(work, args.threads, spec)
    return run_hf_static(work, args.threads, spec, args.static_batch_size)


def _report(results: list[RunResult], args: argparse.Namespace) -> None:
    """The workload, each system against the first, and the saved JSON (``--save-result``)."""
    base = results[0]
    print(
        f"\nworkload: {args.num_prompts} prompts, {args.min_prompt}-{args.max_prompt} prompt tokens, "
        f"{args.min_new}-{args.max_new} new tokens, greedy, {args.model} ({args.load_format}) in {args.dtype} "
        f"on {_machine(args.device)}"
    )
    for r in results[1:]:
        print(f"{base.system} / {r.system}: {base.output_tokens_per_s / r.output_tokens_per_s:.2f}x")
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


if __name__ == "__main__":
    raise SystemExit(main())
