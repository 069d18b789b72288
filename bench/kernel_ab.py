"""The CPU's C kernels of another commit against this checkout's, interleaved in one process, so that a noisy
machine's slow minutes hit both sides alike: the fused ops (csrc/cpu_ops.c), decode attention
(engine/executor/attention/csrc/paged_decode.c) and the matmuls: in float32 the small-batch kernel's
(csrc/small_gemm.c), in bfloat16 on a CPU with AMX csrc/amx_gemm.c's, and csrc/amx_qgemm.c's over 4-bit blocks for
decode-sized calls; without AMX, on AVX512-BF16, csrc/bf16_gemm.c's over bfloat16 panels and (up to 12 rows)
over 4-bit blocks (both sides bound and packed by this checkout's bf16_gemm.py: a before side must have the
same C interface and block layout).

    python -m bench.kernel_ab --before f4cf4a7 [--rows 16 2048] [--rounds 15] [--dtype bfloat16]

The before side's kernel sources come from ``git archive`` of ``--before`` (run from the repository), built as
the engine builds its own (engine/cpu/native_build.py). Per row count: SiLU-and-multiply over SmolLM2-135M's
gate and up halves (and Gemma's GELU-tanh-and-multiply over them), RMSNorm with the residual add, the rotary
embedding of the queries, and the four projections of ``--layers`` layers with weights of their own (so that,
as in a forward, each call reads its weights from memory, not from a cache the previous call warmed) -- over
bfloat16 tiles and, for up to 32 rows, over Q4_1 blocks expanded into the tiles as a decode step reads them,
and the output head over Q8_0 blocks to float32 logits (each side packs the blocks with its own commit's
``amx_qgemm.pack`` and binds its kernel with that commit's ``AmxQGemm``); for more, SwiGLU's gate and up
projections and gate (one call where the side has ``AmxGemm.swiglu``) --, and the decode attention of
``--layers`` layers' caches (each row ``--context`` tokens, its pages scattered over the cache) for up to 64
rows, the prefill attention of prompts of ``--prompt-len`` tokens (``rows`` tokens in all) for more. Prints
each side's best and median over the rounds, and whether both sides give the same bits.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import itertools
import statistics
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from io import BytesIO
from pathlib import Path
from types import ModuleType

import torch

from engine.cpu.native_build import BuildOnce, KernelUnavailable
from engine.executor.attention import cpu_kernel
from engine.executor.attention.cpu_kernel import PagedDecodeKernel
from engine.executor.kernels import amx_gemm, amx_qgemm, bf16_gemm, cpu_ops, small_gemm
from engine.executor.kernels.amx_gemm import AmxGemm
from engine.executor.kernels.amx_qgemm import AmxQGemm
from engine.executor.kernels.bf16_gemm import Bf16Gemm
from engine.executor.kernels.block_codes import BlockCodes
from engine.executor.kernels.cpu_ops import CpuOps
from engine.executor.kernels.small_gemm import SmallGemm

KERNELS = "engine/executor/kernels/csrc"
ATTENTION = "engine/executor/attention/csrc"
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # the projections' (out, in): SmolLM2-135M's
HIDDEN, INTER, HEADS, HEAD_DIM, VOCAB = 576, 1536, 9, 64, 49152
KV_HEADS, BLOCK_SIZE = 3, 16
MAX_DECODE_ROWS = 64  # the attention case runs for decode-sized row counts only


def checkout_kernels(rev: str, into: Path) -> Path:
    """The kernel sources of ``rev`` (the matmuls' and fused ops', and attention's) under ``into``; returns
    the folder of the first (attention's is ``into / ATTENTION``)."""
    tar = subprocess.run(["git", "archive", rev, KERNELS, ATTENTION], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")
    return into / KERNELS


def checkout_qgemm(rev: str, into: Path) -> ModuleType:
    """``rev``'s engine/executor/kernels/amx_qgemm.py (imported from its source under ``into``): its ``pack``
    gives the layout its kernel reads, its ``AmxQGemm`` binds that kernel."""
    source = subprocess.run(
        ["git", "show", f"{rev}:engine/executor/kernels/amx_qgemm.py"], capture_output=True, check=True
    ).stdout
    path = into / "amx_qgemm_before.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("amx_qgemm_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def op_cases(ops: CpuOps, rows: int, dtype: torch.dtype) -> dict[str, Callable[[], torch.Tensor]]:
    """Each fused op on ``rows`` rows of random data (the same data for both sides: seeded)."""
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * INTER, generator=gen).to(dtype)
    x, weight = (
        torch.randn(rows, HIDDEN, generator=gen).to(dtype),
        torch.randn(HIDDEN, generator=gen).to(dtype),
    )
    residual = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
    cos, sin = (torch.randn(rows, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    positions = torch.arange(rows, dtype=torch.int64)

    def norm() -> torch.Tensor:  # the residual grows by x at each call, on both sides alike
        return ops.rms_norm(x, weight, 1e-5, residual)

    def rotary() -> torch.Tensor:  # rotated in place, again at each call
        ops.rotary(q, positions, cos, sin)
        return q

    return {
        "silu_and_mul": lambda: ops.silu_and_mul(gate_up),
        "gelu_tanh_and_mul": lambda: ops.gelu_tanh_and_mul(gate_up),
        "add_rms_norm": norm,
        "rotary": rotary,
    }


class DotBlocks:
    """The AVX512-BF16 kernel's calls over blocks with ``AmxQGemm.linear``'s signature (the Q4_1 and head
    cases call that)."""

    def __init__(self, gemm: Bf16Gemm) -> None:
        self.gemm = gemm

    def linear(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        four_bit: bool,
        out_features: int,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> torch.Tensor:
        return self.gemm.qlinear(x, packed, four_bit, out_features, bias, out_dtype)


def matmul_case(gemm: AmxGemm | Bf16Gemm, rows: int, layers: int) -> Callable[[], torch.Tensor]:
    """The four projections of ``layers`` layers on ``rows`` rows, each layer its own weights."""
    gen = torch.Generator().manual_seed(rows)
    weights = [
        [(n, k, gemm.pack((torch.randn(n, k, generator=gen) * 0.05).bfloat16())) for n, k in SHAPES]
        for _ in range(layers)
    ]
    inputs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k in SHAPES}

    def run() -> torch.Tensor:
        last = torch.empty(0)
        for layer in weights:
            for n, k, packed in layer:
                last = gemm.linear(inputs[k], packed, n, None)
        return last  # the bits compared: the last projection's

    return run


def f32_matmul_case(gemm: SmallGemm, rows: int, layers: int) -> Callable[[], torch.Tensor]:
    """The four projections of ``layers`` layers on ``rows`` rows in float32 (the small-batch kernel's
    panels), each layer its own weights."""
    gen = torch.Generator().manual_seed(rows)
    weights = [
        [(n, k, gemm.pack(torch.randn(n, k, generator=gen) * 0.05)) for n, k in SHAPES] for _ in range(layers)
    ]
    inputs = {k: torch.randn(rows, k, generator=gen) for _, k in SHAPES}

    def run() -> torch.Tensor:
        last = torch.empty(0)
        for layer in weights:
            for n, k, packed in layer:
                last = gemm.linear(inputs[k], packed, n, None)
        return last

    return run


def gated_mlp_case(gemm: AmxGemm, ops: CpuOps, rows: int, layers: int) -> Callable[[], torch.Tensor]:
    """SwiGLU's gate and up projections and its gate over ``layers`` layers' weights: in one call where the
    side's kernel has it (``AmxGemm.swiglu``), else the matmul then the fused op."""
    gen = torch.Generator().manual_seed(rows)
    weights = [
        gemm.pack((torch.randn(2 * INTER, HIDDEN, generator=gen) * 0.05).bfloat16()) for _ in range(layers)
    ]
    x = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
    one_call = gemm.swiglu if gemm.has_swiglu else None

    def run() -> torch.Tensor:
        last = torch.empty(0)
        for packed in weights:
            if one_call is not None:
                last = one_call(x, packed, INTER)
            else:
                last = ops.silu_and_mul(gemm.linear(x, packed, 2 * INTER, None))
        return last

    return run


def q4_codes(n: int, k: int, gen: torch.Generator) -> BlockCodes:
    """A random ``[n, k]`` Q4_1 weight whose blocks the AMX kernel takes bit for bit (``amx_qgemm.pack``):
    scales and offsets on float16 steps that keep ``offset - scale * 128`` exact."""
    blocks = (n, k // 32)
    scales = torch.randint(1, 64, blocks, generator=gen).float() * 2.0**-12
    offsets = -torch.randint(0, 64, blocks, generator=gen).float() * 2.0**-9
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int8)
    return BlockCodes(codes, scales, offsets)


Pack = Callable[[BlockCodes], "tuple[torch.Tensor, bool] | None"]


def qmatmul_case(
    qgemm: AmxQGemm | DotBlocks, pack: Pack, rows: int, layers: int
) -> Callable[[], torch.Tensor]:
    """The four projections of ``layers`` layers on ``rows`` rows over Q4_1 blocks, each layer its own."""
    gen = torch.Generator().manual_seed(rows)
    weights = []
    for _ in range(layers):
        layer = []
        for n, k in SHAPES:
            packed = pack(q4_codes(n, k, gen))
            assert packed is not None and packed[1], "the AMX kernel takes these blocks"
            layer.append((n, packed[0]))
        weights.append(layer)
    inputs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k in SHAPES}

    def run() -> torch.Tensor:
        last = torch.empty(0)
        for layer in weights:
            for (n, packed), (_, k) in zip(layer, SHAPES, strict=True):
                last = qgemm.linear(inputs[k], packed, True, n, None)
        return last

    return run


def head_case(qgemm: AmxQGemm | DotBlocks, pack: Pack, rows: int) -> Callable[[], torch.Tensor]:
    """SmolLM2-135M's output head (49,152 x 576) over Q8_0 blocks, on ``rows`` rows, to float32 logits as the
    model takes them: written as float32 by a kernel that can (``out_dtype``), else bfloat16 widened after."""
    gen = torch.Generator().manual_seed(rows)
    scales = torch.randint(1, 64, (VOCAB, HIDDEN // 32), generator=gen).float() * 2.0**-12
    codes = torch.randint(-128, 128, (VOCAB, HIDDEN), generator=gen, dtype=torch.int8)
    packed = pack(BlockCodes(codes, scales))
    assert packed is not None and not packed[1], "the AMX kernel takes these blocks"
    x = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
    if "out_dtype" in inspect.signature(qgemm.linear).parameters:
        return lambda: qgemm.linear(x, packed[0], False, VOCAB, None, out_dtype=torch.float32)
    return lambda: qgemm.linear(x, packed[0], False, VOCAB, None).float()


def attention_case(
    kernel: PagedDecodeKernel, rows: int, layers: int, context: int, dtype: torch.dtype
) -> Callable[[], torch.Tensor]:
    """Decode attention of ``rows`` rows of ``context`` tokens over ``layers`` layers' caches, each row's pages
    scattered (seeded: the same for both sides)."""
    gen = torch.Generator().manual_seed(rows)
    pages = -(-context // BLOCK_SIZE)
    blocks = rows * pages + 1
    tables = (torch.randperm(blocks - 1, generator=gen)[: rows * pages] + 1).view(rows, pages).contiguous()
    caches = [
        (
            torch.randn(blocks, KV_HEADS, HEAD_DIM, BLOCK_SIZE, generator=gen).to(dtype),
            torch.randn(blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM, generator=gen).to(dtype),
        )
        for _ in range(layers)
    ]
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
    lens = torch.full((rows,), context, dtype=torch.int64)

    def run() -> torch.Tensor:
        last = torch.empty(0)
        for k, v in caches:
            last = kernel(q, k, v, tables, lens, HEAD_DIM**-0.5, None)
        return last

    return run


def prefill_attention_case(
    kernel: PagedDecodeKernel, rows: int, layers: int, prompt_len: int, dtype: torch.dtype
) -> Callable[[], torch.Tensor]:
    """Prefill attention of ``rows`` new tokens, prompts of ``prompt_len`` (the last one shorter where it does
    not divide), over ``layers`` layers' caches, each prompt's pages scattered (seeded: the same for both
    sides); bfloat16 queries take the AMX tiles where the CPU has them."""
    gen = torch.Generator().manual_seed(rows)
    lens = [prompt_len] * (rows // prompt_len) + ([rows % prompt_len] if rows % prompt_len else [])
    pages = -(-prompt_len // BLOCK_SIZE)
    blocks = len(lens) * pages + 1
    tables = (torch.randperm(blocks - 1, generator=gen)[: len(lens) * pages] + 1).view(len(lens), pages)
    caches = [
        (
            torch.randn(blocks, KV_HEADS, HEAD_DIM, BLOCK_SIZE, generator=gen).to(dtype),
            torch.randn(blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM, generator=gen).to(dtype),
        )
        for _ in range(layers)
    ]
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
    starts = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int64)
    seq_lens = torch.tensor(lens, dtype=torch.int64)

    def run() -> torch.Tensor:
        last = torch.empty(0)
        for k, v in caches:
            last = kernel.prefill(q, k, v, tables.contiguous(), starts, seq_lens, HEAD_DIM**-0.5, None)
        return last

    return run


def compare(cases: dict[str, dict[str, Callable[[], torch.Tensor]]], rounds: int) -> None:
    """Time every case on both sides, alternating which goes first; print a line per case."""
    sides = list(cases)
    for name in cases[sides[0]]:
        same = torch.equal(*(cases[side][name]().view(torch.int16) for side in sides))
        times: dict[str, list[float]] = {side: [] for side in sides}
        for r in range(rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                times[side].append(timed(cases[side][name]))
        cells = [
            f"{side} best {1e3 * min(t):8.3f} ms median {1e3 * statistics.median(t):8.3f} ms"
            for side, t in times.items()
        ]
        print(f"{name:22s} " + " | ".join(cells) + f" | {'same bits' if same else 'BITS DIFFER'}", flush=True)


Sides = tuple[
    dict[str, SmallGemm], dict[str, AmxGemm | Bf16Gemm], dict[str, AmxQGemm | DotBlocks], dict[str, Pack]
]


def matmul_sides(before: Path, before_qgemm: ModuleType, dtype: torch.dtype) -> Sides:
    """Both sides' matmul kernels for ``dtype``: the small-batch kernel's (float32), or the AMX kernels, else
    the AVX512-BF16 ones (bfloat16), and each side's packing of blocks; none where they cannot be built here
    (said so)."""
    smalls: dict[str, SmallGemm] = {}
    gemms: dict[str, AmxGemm | Bf16Gemm] = {}
    qgemms: dict[str, AmxQGemm | DotBlocks] = {}
    packs: dict[str, Pack] = {}
    try:
        if dtype == torch.float32:
            smalls = {"before": BuildOnce(before / "small_gemm.c", SmallGemm)(), "after": small_gemm.load()}
        elif amx_gemm.load.available():
            gemms = {"before": BuildOnce(before / "amx_gemm.c", AmxGemm)(), "after": amx_gemm.load()}
            before_q = BuildOnce(before / "amx_qgemm.c", before_qgemm.AmxQGemm)()
            qgemms = {"before": before_q, "after": amx_qgemm.load()}
            packs = {"before": before_qgemm.pack, "after": amx_qgemm.pack}
        else:
            dots = {"before": BuildOnce(before / "bf16_gemm.c", Bf16Gemm)(), "after": bf16_gemm.load()}
            gemms = dict(dots)
            qgemms = {side: DotBlocks(dot) for side, dot in dots.items()}
            packs = dict.fromkeys(dots, Bf16Gemm.pack_blocks)
    except (KernelUnavailable, FileNotFoundError) as e:
        print(f"no {dtype} matmul on both sides here ({e}): the fused ops and attention only")
    return smalls, gemms, qgemms, packs



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the commit whose kernels are the before side")
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 2048])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--layers", type=int, default=30, help="layers of weights the matmul case reads")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument(
        "--context", type=int, default=160, help="tokens of each row the attention case reads"
    )
    parser.add_argument(
        "--prompt-len", type=int, default=128, help="tokens a prompt of the prefill attention case"
    )
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        before = checkout_kernels(args.before, Path(tmp))
        ops = {"before": BuildOnce(before / "cpu_ops.c", CpuOps)(), "after": cpu_ops.load()}
        attention = {
            "before": BuildOnce(Path(tmp) / ATTENTION / cpu_kernel.SOURCE.name, PagedDecodeKernel)(),
            "after": cpu_kernel.load(),
        }
        before_qgemm = checkout_qgemm(args.before, Path(tmp))
        smalls, gemms, qgemms, packs = matmul_sides(before, before_qgemm, dtype)
        for rows in args.rows:
            print(f"rows {rows}, {args.dtype}, before {args.before}:")
            cases = {side: op_cases(o, rows, dtype) for side, o in ops.items()}
            for side, kernel in attention.items() if rows <= MAX_DECODE_ROWS else ():
                name = f"{args.layers} layers' decode attention"
                cases[side][name] = attention_case(kernel, rows, args.layers, args.context, dtype)
            for side, kernel in attention.items() if rows > MAX_DECODE_ROWS else ():
                name = f"{args.layers} layers' prefill attention"
                cases[side][name] = prefill_attention_case(kernel, rows, args.layers, args.prompt_len, dtype)
            for side, gemm in gemms.items():
                cases[side][f"{args.layers} layers' matmuls"] = matmul_case(gemm, rows, args.layers)
            for side, small in smalls.items():
                cases[side][f"{args.layers} layers' matmuls"] = f32_matmul_case(small, rows, args.layers)
            for side, gemm in gemms.items() if rows > amx_qgemm.MAX_ROWS else ():
                if isinstance(gemm, AmxGemm):
                    name = f"{args.layers} layers' SwiGLU gate"
                    cases[side][name] = gated_mlp_case(gemm, ops[side], rows, args.layers)
            for side, qgemm in qgemms.items():
                if rows > _max_block_rows(qgemm):
                    continue
                name = f"{args.layers} layers' Q4_1 matmuls"
                cases[side][name] = qmatmul_case(qgemm, packs[side], rows, args.layers)
                cases[side]["output head, Q8_0"] = head_case(qgemm, packs[side], rows)
            compare(cases, args.rounds)
    return 0


def _max_block_rows(qgemm: AmxQGemm | DotBlocks) -> int:
    """The most rows a call over blocks takes on this kernel."""
    return bf16_gemm.QUANTIZED_MAX_ROWS if isinstance(qgemm, DotBlocks) else amx_qgemm.MAX_ROWS


if __name__ == "__main__":
    raise SystemExit(main())
