"""The ceiling of a serving workload on this CPU: the output tokens/s that no float32 (or, with ``--dtype
bfloat16``, bfloat16) server can beat here, because the run's matrix multiplications alone take that long at
this machine's multiply-add peak, or its decode steps take that long to read the weights at this machine's
memory bandwidth -- whichever binds.

    python -m bench.cpu_ceiling results/DIR/*.json          # saved runs (--save-result): each one's ceiling
    python -m bench.cpu_ceiling --num-prompts 32 --random-input-len 128 --random-output-len 64
    python -m bench.cpu_ceiling --dtype bfloat16 results/DIR/cbserve-bf16-*.json

Compute: the peak is measured, not looked up: a C loop of independent FMA chains in registers on every
thread (bench/csrc/fma_peak.c), best of ``--rounds``. The bfloat16 peak is that of the CPU's widest bfloat16
instruction (bench/csrc/bf16_peak.c: AMX tiles where the CPU has AMX-BF16, AVX512-BF16 dot products where it
has those), or the float32 one where it has neither. The work is counted from the model's config and each
request's prompt and output lengths, and only what any implementation must compute: every prompt token and
every generated token but the last goes through every layer (in the last layer a prompt token that needs no
logits needs only its key and value), one row of the output head per generated token, and causal attention.

Memory: with at most C requests in flight (the run's ``max_concurrency``), a step yields at most C output
tokens, so the run takes at least ``output tokens / C`` forwards, and each reads every weight once (the
layers' projections and the output head, in the dtype's bytes: a server holding its weights so). The
bandwidth is measured as the best rate of streaming a buffer of that many bytes (from whichever level of
the memory holds it: a large L3 may) through vector adds on ``--threads`` threads (bench/csrc/mem_read.c).
The ceiling leaves the KV cache's reads out (so it stays a bound however much of the cache a CPU's caches
hold); a second line adds them at the same bandwidth (every fed-back token's keys and values in every
layer): the tighter bound where the K and V stream from where the weights do -- at 16 streams of SmolLM2 a
decode step's K and V are about as many bytes as its layers' Q4_1 blocks.
With ``--dtype bfloat16``, for a GGUF whose matrices are stored in blocks, a second bound counts the blocks' bytes instead: cbserve's
bfloat16 decode steps read those (engine/executor/kernels/amx_qgemm.py), so the first is no bound for them.

With ``--times N`` each run also says what N times its own throughput would need, as a share of the
ceiling: above 100% no server in this precision can do it on this machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader

from engine.cpu.native_build import BuildOnce
from engine.loader.dummy import PRESETS, get_preset
from engine.loader.model_loader import open_source
from engine.loader.source import DEFAULT_MODEL, resolve_model
from engine.model_config import ModelConfig

SOURCE = Path(__file__).parent / "csrc" / "fma_peak.c"
BF16_SOURCE = Path(__file__).parent / "csrc" / "bf16_peak.c"
MEM_SOURCE = Path(__file__).parent / "csrc" / "mem_read.c"
BF16_KINDS = {1: "AVX512-BF16 dot products", 2: "AMX-BF16 tiles"}


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.fma_peak_run.argtypes = [ctypes.c_long, ctypes.c_int]
    lib.fma_peak_run.restype = ctypes.c_double
    return lib


def _bind_bf16(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.bf16_peak_run.argtypes = [ctypes.c_long, ctypes.c_int]
    lib.bf16_peak_run.restype = ctypes.c_double
    lib.bf16_peak_kind.restype = ctypes.c_int
    return lib


def _bind_mem(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.mem_read_run.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_long, ctypes.c_int]
    lib.mem_read_run.restype = ctypes.c_double
    return lib


load = BuildOnce(SOURCE, _bind)
load_bf16 = BuildOnce(BF16_SOURCE, _bind_bf16)
load_mem = BuildOnce(MEM_SOURCE, _bind_mem)


def fma_peak_gflops(threads: int, seconds: float = 0.5, rounds: int = 5) -> float:
    """The best GFLOPS of ``rounds`` runs of the FMA loop on ``threads`` threads, each ~``seconds`` long."""
    return _best_gflops(load().fma_peak_run, threads, seconds, rounds)


def bf16_peak_gflops(threads: int, seconds: float = 0.5, rounds: int = 5) -> tuple[float, str]:
    """The bfloat16 peak (best GFLOPS of ``rounds`` runs) and the instruction that gave it; the float32 FMA
    peak where the CPU has no bfloat16 instruction."""
    lib = load_bf16()
    kind = int(lib.bf16_peak_kind())
    if kind not in BF16_KINDS:
        return fma_peak_gflops(threads, seconds, rounds), "float32 FMA (no bfloat16 instructions)"
    return _best_gflops(lib.bf16_peak_run, threads, seconds, rounds), BF16_KINDS[kind]


def _best_gflops(run: Any, threads: int, seconds: float, rounds: int) -> float:
    iterations = 1 << 10
    while True:  # size a round to ~seconds (the first call also starts the OpenMP threads)
        start = time.perf_counter()
        run(iterations, threads)
        if time.perf_counter() - start >= seconds / 4 or iterations >= 1 << 40:
            break
        iterations *= 4
    iterations = max(1, int(iterations * seconds / max(time.perf_counter() - start, 1e-9)))
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        flops = run(iterations, threads)
        best = max(best, flops / (time.perf_counter() - start) / 1e9)
    return best


@dataclass(frozen=True)
class Work:
    """Floating-point operations a run must do, by kind."""

    linear: float  # the layers' projections and the output head
    attention: float  # q.k and p.v

    @property
    def total(self) -> float:
        return self.linear + self.attention


def request_work(config: ModelConfig, prompt_len: int, output_len: int) -> Work:
    """The least work of one request: ``prompt_len`` tokens in, ``output_len`` tokens out (0 for a failed one)."""
    if output_len <= 0:
        return Work(0.0, 0.0)
    h, hd, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    full = h * (q + 2 * kv) + q * h + h * 2 * config.intermediate_size + config.intermediate_size * h
    kv_only = h * 2 * kv
    fed = prompt_len + output_len - 1  # tokens through the layers: the last generated one never is
    logit_rows = output_len  # the last prompt token's and every fed-back token's
    linear_macs = fed * (layers - 1) * full + logit_rows * full + (prompt_len - 1) * kv_only
    linear_macs += logit_rows * h * config.vocab_size
    # causal attention: the token at position t attends t + 1 keys, q.k and p.v over every query head
    keys_all = fed * (fed + 1) // 2
    keys_logit_rows = keys_all - (prompt_len - 1) * prompt_len // 2  # last layer: only the rows with logits
    attention_macs = 2 * config.num_attention_heads * hd * ((layers - 1) * keys_all + keys_logit_rows)
    return Work(2.0 * linear_macs, 2.0 * attention_macs)


def run_work(config: ModelConfig, input_lens: list[int], output_lens: list[int]) -> Work:
    parts = [request_work(config, p, o) for p, o in zip(input_lens, output_lens, strict=True)]
    return Work(sum(w.linear for w in parts), sum(w.attention for w in parts))


def model_config(model: str) -> ModelConfig:
    if model in PRESETS:
        return get_preset(model)
    return open_source(resolve_model(model), torch.float32, torch.device("cpu")).config


def weight_bytes(config: ModelConfig, bytes_per_weight: int) -> float:
    """Bytes a forward reads at least once: every layer's projections and the output head."""
    h, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h
    return float(bytes_per_weight * (config.num_hidden_layers * per_layer + config.vocab_size * h))


def stored_weight_bytes(model: str) -> float | None:
    """The same matrices' bytes as a GGUF stores them (its blocks, with their scales): what a server that
    reads the blocks in its decode steps reads a step, as cbserve's bfloat16 steps of up to 32 sequences do
    (engine/executor/kernels/amx_qgemm.py); None for a dummy preset or any other checkpoint."""
    if model in PRESETS:
        return None
    source = resolve_model(model)
    if source.kind != "gguf" or source.path is None:
        return None
    tensors = GGUFReader(str(source.path)).tensors
    untied = any(t.name == "output.weight" for t in tensors)  # else the embedding is the head, read a step
    matrices = [t for t in tensors if len(t.shape) == 2 and not (untied and t.name == "token_embd.weight")]
    return float(sum(int(t.n_bytes) for t in matrices))


def kv_read_bytes(
    config: ModelConfig, input_lens: list[int], output_lens: list[int], element_bytes: int
) -> float:
    """The K and V bytes a run's decode steps read at least: each request's fed-back tokens (all its output
    tokens but the last), the i-th at position prompt + i - 1 attending prompt + i keys, each key's K and V
    in every layer. A prefill's reads of its own keys are not counted (a fused kernel keeps them on chip)."""
    per_key = 2 * config.num_key_value_heads * config.head_dim * config.num_hidden_layers * element_bytes
    fed_back = [(p, max(o - 1, 0)) for p, o in zip(input_lens, output_lens, strict=True)]
    keys = sum(f * p + f * (f + 1) // 2 for p, f in fed_back)  # sum over i = 1..f of p + i
    return float(keys * per_key)


def memory_bandwidth_gbs(threads: int, nbytes: float, rounds: int = 5) -> float:
    """The best GB/s of ``rounds`` passes of the read loop over a buffer of ``nbytes`` (a step's weights: in
    whichever level of the memory holds that much) on ``threads`` threads."""
    lib = load_mem()
    n = int(nbytes) // 4 // (256 * threads) * (256 * threads)
    x = torch.ones(n, dtype=torch.float32)
    lib.mem_read_run(x.data_ptr(), n, 1, threads)  # page it in, start the threads
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        read = lib.mem_read_run(x.data_ptr(), n, 1, threads)
        best = max(best, read / (time.perf_counter() - start) / 1e9)
    return best


@dataclass(frozen=True)
class Machine:
    """What bounds a run here: the multiply-add peak and the memory bandwidth."""

    peak_gflops: float
    bandwidth_gbs: float


def memory_floor_seconds(output_tokens: int, concurrency: int, weights: float, bandwidth_gbs: float) -> float:
    """The least time ``output_tokens`` take at most ``concurrency`` a step, each step reading ``weights``
    bytes at ``bandwidth_gbs``."""
    steps = -(-output_tokens // max(concurrency, 1))
    return steps * weights / (bandwidth_gbs * 1e9)


def floor_seconds(work: Work, peak_gflops: float) -> float:
    """The least time ``work`` takes at ``peak_gflops``."""
    return work.total / (peak_gflops * 1e9)


def ceiling_tok_s(work: Work, output_tokens: int, peak_gflops: float) -> float:
    """The output tokens/s that no server beats on a run of ``work`` at ``peak_gflops`` (inf for a run with
    nothing to compute)."""
    floor_s = floor_seconds(work, peak_gflops)
    return output_tokens / floor_s if floor_s > 0 else float("inf")


def report(
    label: str,
    work: Work,
    output_tokens: int,
    memory: tuple[int, float],
    machine: Machine,
    measured: float | None,
    times: float,
    stored: float | None = None,
    kv: float = 0.0,
) -> str:
    """A run's ceiling; ``memory``: (its concurrency, the bytes of weights a step reads); ``stored``: the
    checkpoint's bytes of the same matrices where it stores them in blocks (``stored_weight_bytes``), whose
    bound is reported too; ``kv``: the bytes of K and V its decode steps read (``kv_read_bytes``), whose
    tighter bound (the weights' and the KV cache's reads at the same bandwidth) is reported where given."""
    concurrency, weights = memory
    compute_s = floor_seconds(work, machine.peak_gflops)
    memory_s = memory_floor_seconds(output_tokens, concurrency, weights, machine.bandwidth_gbs)
    floor_s = max(compute_s, memory_s)
    ceiling = output_tokens / floor_s if floor_s > 0 else float("inf")
    steps = -(-output_tokens // max(concurrency, 1))
    lines = [
        f"{label}: {output_tokens} output tokens, {work.linear / 1e12:.3f} TFLOP of matmuls + "
        f"{work.attention / 1e12:.3f} of attention = {compute_s:.2f} s at the peak; {steps} steps of at most "
        f"{concurrency} reading {weights / 1e9:.3f} GB of weights = {memory_s:.2f} s at "
        f"{machine.bandwidth_gbs:.1f} GB/s: ceiling {ceiling:.1f} tok/s "
        f"({'memory' if memory_s > compute_s else 'compute'}-bound)"
    ]
    if measured is not None:
        lines.append(f"  served {measured:.1f} tok/s = {100 * measured / ceiling:.0f}% of the ceiling")
        wanted = times * measured
        lines.append(
            f"  {times:g}x that = {wanted:.1f} tok/s = {100 * wanted / ceiling:.0f}% of the ceiling"
            + (" (beyond what this precision can do here)" if wanted > ceiling else "")
        )
    if kv > 0:
        kv_s = max(compute_s, memory_s + kv / (machine.bandwidth_gbs * 1e9))
        tighter = output_tokens / kv_s if kv_s > 0 else float("inf")
        served = f", served {100 * measured / tighter:.0f}% of it" if measured is not None else ""
        lines.append(
            f"  with the KV cache's reads too ({kv / 1e9:.3f} GB over the run: each fed-back token's keys and "
            f"values in every layer): ceiling {tighter:.1f} tok/s{served}"
        )
    if stored is not None:
        blocks_s = max(
            compute_s, memory_floor_seconds(output_tokens, concurrency, stored, machine.bandwidth_gbs)
        )
        bound = output_tokens / blocks_s if blocks_s > 0 else float("inf")
        served = f", served {100 * measured / bound:.0f}% of it" if measured is not None else ""
        lines.append(
            f"  reading the checkpoint's blocks instead ({stored / 1e9:.3f} GB a step, as cbserve's bfloat16 "
            f"decode steps of up to 32 rows on AMX, 12 on AVX512-BF16 do): bound {bound:.1f} tok/s{served}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "runs", nargs="*", help="saved runs (bench --save-result JSON): their prompt and output lengths"
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="a model name, path or dummy preset (its shapes)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight (all by default)")
    p.add_argument(
        "--times", type=float, default=4.0, help="what this multiple of each run's throughput needs"
    )
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--seconds", type=float, default=0.5, help="length of one round of the FMA loop")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="whose peak")
    args = p.parse_args(argv)
    config = model_config(args.model)
    if args.dtype == "bfloat16":
        peak, kind = bf16_peak_gflops(args.threads, args.seconds, args.rounds)
        print(f"bfloat16 peak: {peak:.1f} GFLOPS on {args.threads} threads ({kind}, best of {args.rounds})")
    else:
        peak = fma_peak_gflops(args.threads, args.seconds, args.rounds)
        print(f"FMA peak: {peak:.1f} GFLOPS on {args.threads} threads (float32, best of {args.rounds})")
    element = 2 if args.dtype == "bfloat16" else 4  # the weights' and the KV cache's bytes an element
    weights = weight_bytes(config, element)
    bandwidth = memory_bandwidth_gbs(args.threads, weights, args.rounds)
    print(
        f"memory bandwidth: {bandwidth:.1f} GB/s on {args.threads} threads, reading {weights / 1e9:.3f} GB "
        f"(best of {args.rounds})"
    )
    machine = Machine(peak, bandwidth)
    # NOTE: only bfloat16 steps read these bytes (float32 steps of up to six rows read their own int8 panels)
    stored = stored_weight_bytes(args.model) if args.dtype == "bfloat16" else None
    if not args.runs:
        n = args.num_prompts
        lens = [args.random_input_len] * n, [args.random_output_len] * n
        work, kv = run_work(config, *lens), kv_read_bytes(config, *lens, element)
        memory = (args.max_concurrency or n, weights)
        print(
            report(
                "workload", work, n * args.random_output_len, memory, machine, None, args.times, stored, kv
            )
        )
        return 0
    for path in args.runs:
        doc: dict[str, Any] = json.loads(Path(path).read_text())
        input_lens, output_lens = [int(x) for x in doc["input_lens"]], [int(x) for x in doc["output_lens"]]
        work = run_work(config, input_lens, output_lens)
        label = str(doc.get("label") or Path(path).stem)
        memory = (int(doc.get("max_concurrency") or len(output_lens)), weights)
        measured = float(doc["output_throughput"])
        kv = kv_read_bytes(config, input_lens, output_lens, element)
        print(report(label, work, sum(output_lens), memory, machine, measured, args.times, stored, kv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
