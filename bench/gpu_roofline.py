"""How close a decode step and a prefill come to the GPU's limits (#24's CUDA goals), on a dummy model.

    python -m bench.gpu_roofline [--model llama-3-8b] [--batch 64] [--context 1024] [--prefill-seqs 8]

Measures, on this GPU, in one process:
- the copy bandwidth (a device-to-device copy of 4 GiB, bytes read plus bytes written over its time) and
  the bfloat16 tensor-core peak (an 8192^3 matmul), each the mean of ten after three warm-ups;
- the prefill of ``--batch`` prompts of ``--context`` tokens, ``--prefill-seqs`` prompts a forward: its
  FLOPs (2 x parameters x tokens in the linears, the causal attention's QK^T and PV, the head over one row a
  prompt) over its time, against the matmul peak (goal: at least 50%);
- one decode step of the ``--batch`` sequences (their prompts now in the cache), replayed from a CUDA graph
  as the engine does: the bytes it must read (every weight but the embedding table, one embedding row a
  sequence, every sequence's K and V) over the copy bandwidth is the roofline (goal: within 1.4x);
- how far a sequence's decode logits move between a step alone and a step of ``--batch`` (batch
  invariance: 0 only with kernels that promise it).

Weights are random (``load_format="dummy"``): shapes, not values, set the time. Prints one table.
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable

import torch

from engine.executor.attention.backend import select_decode_kernel
from engine.executor.cuda_graphs import CudaGraphDecoder
from engine.executor.inputs import BatchInputs
from engine.executor.kernels.triton_rms_norm import TritonRMSNorm
from engine.executor.kv_cache import KVCache
from engine.executor.models.layers import RMSNorm
from engine.loader.model_loader import load_model
from engine.model_config import ModelConfig

BLOCK = 16


def _mean_ms(fn: Callable[[], object], warmup: int = 3, runs: int = 10) -> float:
    """Mean milliseconds of ``fn`` on the current stream, by CUDA events."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(runs):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / runs


def copy_bandwidth(device: torch.device) -> float:
    """Bytes a second a device-to-device copy moves, read plus written."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _mean_ms(lambda: dst.copy_(src))
    return 2 * (4 << 30) / (ms / 1e3)


def matmul_peak(device: torch.device) -> float:
    """FLOP/s of an 8192^3 bfloat16 matmul on random data."""
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = _mean_ms(lambda: a @ b)
    return 2 * n**3 / (ms / 1e3)


def _linear_params(model: torch.nn.Module) -> tuple[int, int, int]:
    """(parameters of every layer's linears and norms, the embedding table's, the head's) in elements."""
    embed = head = other = 0
    for name, p in model.named_parameters():
        if "embed" in name:
            embed += p.numel()
        elif "lm_head" in name:
            head += p.numel()
        else:
            other += p.numel()
    return other, embed, head


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill-seqs", type=int, default=8)
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument(
        "--pytorch-norm", action="store_true", help="the norms in PyTorch, not Triton's kernel"
    )
    parser.add_argument(
        "--sweep", action="store_true", help="also time the decode step with SWEEP's settings"
    )
    parser.add_argument("--profile", action="store_true", help="also print the top kernels of an eager step")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    device = torch.device("cuda")
    torch.manual_seed(0)
    bandwidth, peak = copy_bandwidth(device), matmul_peak(device)
    loaded = load_model(
        args.model, load_format="dummy", dtype="bfloat16", device="cuda", batch_invariant=args.batch_invariant
    )
    model, cfg = loaded.model, loaded.config
    if args.pytorch_norm:
        for module in model.modules():
            if type(module) is TritonRMSNorm:
                module.__class__ = RMSNorm  # type: ignore[assignment]
    assert isinstance(cfg, ModelConfig), "a native model's config"
    width = math.ceil((args.context + 1) / BLOCK)
    cache = KVCache(
        cfg.num_hidden_layers, 1 + args.batch * width, BLOCK, cfg.num_key_value_heads, cfg.head_dim,
        torch.bfloat16, device,
    )  # fmt: skip
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    kernel = select_decode_kernel(
        "auto", device, torch.bfloat16, cfg.head_dim, BLOCK, group, batch_invariant=loaded.batch_invariant
    )
    tables = [list(range(1 + i * width, 1 + (i + 1) * width)) for i in range(args.batch)]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.context), generator=gen).tolist()
    other, embed, head = _linear_params(model)
    prefill_ms = _prefill(model, cache, kernel, prompts, tables, args.prefill_seqs)
    flops = _prefill_flops(cfg, other, head, args.prefill_seqs, args.context)
    step_ms, delta = _decode(model, cache, kernel, prompts, tables, args.context, cfg.max_position_embeddings)
    step_bytes = _decode_bytes(cfg, other, head, args.batch, args.context)
    roofline_ms = step_bytes / bandwidth * 1e3
    print(
        f"GPU: {torch.cuda.get_device_name(device)}; model {args.model} bfloat16 (dummy weights); torch {torch.__version__}"
    )
    print(
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write); bf16 matmul peak {peak / 1e12:.0f} TFLOP/s"
    )
    print("| measure | value | limit | ratio |\n|---|---|---|---|")
    print(
        f"| prefill, {args.prefill_seqs} x {args.context} tokens a forward | {prefill_ms:.2f} ms, "
        f"{flops / (prefill_ms / 1e3) / 1e12:.0f} TFLOP/s | {peak / 1e12:.0f} TFLOP/s | "
        f"{flops / (prefill_ms / 1e3) / peak:.0%} of peak |"
    )
    print(
        f"| decode step, {args.batch} x {args.context + 1} tokens (CUDA graph) | {step_ms:.2f} ms | "
        f"{roofline_ms:.2f} ms ({step_bytes / 1e9:.1f} GB) | {step_ms / roofline_ms:.2f}x the roofline |"
    )
    print(
        f"| a sequence's decode logits, alone vs in a step of {args.batch} | max abs diff {delta:.3g} | 0 | |"
    )
    if args.sweep:
        _sweep(model, cache, kernel, prompts, tables, args.context, roofline_ms)
    if args.profile:
        _profile_step(model, cache, kernel, prompts, tables, args.context)
    return 0


# launch settings of the decode-attention kernel tried by --sweep:
# (programs_per_sm, tokens_per_split, block_n, num_warps, num_stages)
SWEEP = [
    (4, 512, 64, 2, 2),  # the defaults
    (8, 256, 64, 2, 2),
    (8, 512, 64, 2, 2),
    (4, 512, 32, 2, 2),
    (4, 512, 64, 2, 3),
    (4, 512, 64, 4, 2),
    (4, 512, 128, 2, 2),
    (4, 512, 128, 4, 2),
    (4, 512, 128, 4, 3),
    (2, 1024, 128, 4, 3),
]


@torch.inference_mode()
def _sweep(model, cache, kernel, prompts, tables, context: int, roofline_ms: float) -> None:  # type: ignore[no-untyped-def]
    """The decode step (one CUDA graph of every sequence) with each of ``SWEEP``'s kernel settings."""
    n = len(prompts)
    inputs = BatchInputs.build(
        [[p[-1]] for p in prompts], [context] * n, tables, [1] * n, BLOCK, cache.device
    )
    saved = {
        a: getattr(kernel, a)
        for a in ("programs_per_sm", "tokens_per_split", "block_n", "num_warps", "num_stages")
    }
    print(
        "| programs/SM | tokens/split | BLOCK_N | warps | stages | step ms | x roofline |\n|---|---|---|---|---|---|---|"
    )
    for setting in SWEEP:
        for attr, value in zip(saved, setting, strict=True):
            setattr(kernel, attr, value)
        model(inputs, cache, kernel)  # compiles
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(inputs, cache, kernel)
        ms = _mean_ms(graph.replay, warmup=3, runs=20)
        print(f"| {' | '.join(map(str, setting))} | {ms:.2f} | {ms / roofline_ms:.2f} |")
        del graph
    for attr, value in saved.items():
        setattr(kernel, attr, value)


@torch.inference_mode()
def _profile_step(model, cache, kernel, prompts, tables, context: int) -> None:  # type: ignore[no-untyped-def]
    """The top kernels, by GPU time, of one eager decode step of every sequence."""
    n = len(prompts)
    inputs = BatchInputs.build(
        [[p[-1]] for p in prompts], [context] * n, tables, [1] * n, BLOCK, cache.device
    )
    model(inputs, cache, kernel)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        model(inputs, cache, kernel)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


def _prefill_flops(cfg: ModelConfig, other: int, head: int, seqs: int, context: int) -> float:
    """A prefill forward's FLOPs: the linears over every token, the head over one row a prompt, and the
    causal attention's QK^T and PV."""
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    return 2 * other * seqs * context + 2 * head * seqs + attention * seqs * context * (context + 1) / 2


def _decode_bytes(cfg: ModelConfig, other: int, head: int, batch: int, context: int) -> int:
    """The bytes a bfloat16 decode step must read: every weight but the embedding table, one embedding row
    a sequence, every sequence's K and V (its context and the new token)."""
    kv = batch * (context + 1) * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
    return 2 * (other + head + batch * cfg.hidden_size + kv)


@torch.inference_mode()
def _prefill(model, cache, kernel, prompts, tables, per_forward: int) -> float:  # type: ignore[no-untyped-def]
    """Fill every prompt's pages, ``per_forward`` prompts a forward; the mean ms of a forward, the first
    (which compiles) left out."""
    times = []
    for lo in range(0, len(prompts), per_forward):
        rows = range(lo, min(lo + per_forward, len(prompts)))
        inputs = BatchInputs.build(
            [prompts[i] for i in rows], [0] * len(rows), [tables[i] for i in rows], [1] * len(rows), BLOCK,
            device=cache.device,
        )  # fmt: skip
        times.append(
            _mean_ms(functools.partial(model, inputs, cache, kernel), warmup=1 if lo == 0 else 0, runs=1)
        )
    return sum(times[1:]) / max(1, len(times) - 1) if len(times) > 1 else times[0]


@torch.inference_mode()
def _decode(model, cache, kernel, prompts, tables, context: int, max_len: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """The mean ms of a graph-replayed decode step of every sequence, and the max abs difference of the
    first sequence's logits between that step and a step of it alone."""
    n = len(prompts)
    graphs = CudaGraphDecoder(model, cache, kernel, BLOCK, min(max_len, context + 64), n, cache.device)
    width = len(tables[0])
    graphs.input_ids[:n] = torch.tensor([p[-1] for p in prompts])
    graphs.positions[:n] = context
    graphs.slots[:n] = torch.tensor([t[context // BLOCK] * BLOCK + context % BLOCK for t in tables])
    graphs.seq_lens[:n] = context + 1
    graphs.block_tables[:n, :width] = torch.tensor(tables)
    ms = _mean_ms(graphs.graphs[n].replay, warmup=3, runs=20)
    batched = graphs.logits[n][0].float().clone()
    graphs.graphs[1].replay()
    alone = graphs.logits[1][0].float()
    return ms, float((alone - batched).abs().max())


if __name__ == "__main__":
    raise SystemExit(main())
