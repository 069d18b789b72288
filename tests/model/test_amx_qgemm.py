"""The bfloat16 AMX matmul over a checkpoint's blocks of codes (engine/executor/kernels/amx_qgemm.py), where
the CPU has AMX-BF16:

- 4-bit codes (Q4_1, Q4_0): within float32-accumulation rounding of a float64 reference over the
  checkpoint's own weights (``d c + m``, not rounded to bfloat16), at the model's shapes and at tails, from
  1 to 50 rows;
- 8-bit codes (Q8_0): the weights it expands are the loaded bfloat16 weights, so within rounding of a float64
  reference over them, and the bits of the AMX kernel over the same bfloat16 weights, from 1 to 32 rows;

a row's bits do not depend on the rows beside it nor on the threads; what ``pack`` refuses; argument checks.
In the default model (bfloat16): every projection and the head read their blocks; prefill rows give the
bits of the bfloat16 tiles alone, decode steps (1 to 48 sequences) the same bits in the decode stack and
layer by layer, and logits close to the bfloat16 tiles'; greedy generation the same tokens batched and
chunked."""

from __future__ import annotations

import pytest
import torch
from model_harness import cpu_kernel_or_skip, run_greedy
from test_amx_gemm import BF16_ROUNDOFF, FLOAT32_ROUNDOFF, MODEL_SHAPES, assert_within_rounding

from engine.cpu.native_build import KernelUnavailable
from engine.executor.decode_stack import CpuDecodeStack
from engine.executor.fast_paths import apply_cpu_fast_paths
from engine.executor.inputs import BatchInputs
from engine.executor.kernels import amx_gemm, amx_qgemm
from engine.executor.kernels.amx_gemm import AmxGemm
from engine.executor.kernels.amx_qgemm import AmxQGemm
from engine.executor.kernels.block_codes import BLOCK, BlockCodes
from engine.executor.kernels.modules import QuantAmxLinear
from engine.executor.kv_cache import KVCache
from engine.loader.model_loader import load_model
from engine.model_config import ModelConfig


@pytest.fixture(scope="module")
def kernels() -> tuple[AmxQGemm, AmxGemm]:
    try:
        return amx_qgemm.load(), amx_gemm.load()
    except KernelUnavailable as e:
        pytest.skip(f"the AMX kernels cannot run here: {e}")


def _codes(kind: str, n: int, k: int, gen: torch.Generator) -> BlockCodes:
    """Blocks as a GGUF's: float16 scales (and, Q4_1, offsets near -8 scales: a block's minimum)."""
    blocks = (n, k // BLOCK)
    d = (torch.rand(blocks, generator=gen) * 0.02 + 1e-3).half().float()
    if kind == "q4_1":
        m = (
            (-d * torch.randint(4, 12, blocks, generator=gen) * (0.25 + torch.rand(blocks, generator=gen)))
            .half()
            .float()
        )
        return BlockCodes(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int8), d, m)
    if kind == "q4_0":
        return BlockCodes(torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8), d)
    return BlockCodes(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), d)


KINDS = ["q4_1", "q4_0", "q8_0"]
SHAPES = [*MODEL_SHAPES, (100, 64), (150, 64), (49152 // 16, 576)]


def assert_within_rounding_of_codes(
    ours: torch.Tensor, x: torch.Tensor, codes: BlockCodes, b: torch.Tensor | None
) -> None:
    """The 4-bit kernel's sums: per block S = sum x (1 + c / 16) and X = sum x, each 32 exact products summed
    in float32; then per block acc = fma(D, S, fma(C, X, acc)), D = 16 d, C = m - D rounded once; the bias and
    one rounding to bfloat16. Every float32 step is within gamma(32 + 2 * blocks + 3) of the magnitudes
    |x| (16 |d| (1 + c / 16) + |C|) summed (Higham 3.1), then the bfloat16 rounding."""
    n, k = codes.shape
    blocks = k // BLOCK
    x64 = x.double().view(-1, blocks, BLOCK)
    c = codes.codes.double().view(n, blocks, BLOCK)
    d, m = codes.scales.double(), (codes.offsets if codes.offsets is not None else codes.scales * 0).double()
    if codes.offsets is None:  # Q4_0 as the kernel keeps it: codes + 8, offset -8 d
        c, m = c + 8, -8 * d
    w = (c * d[..., None] + m[..., None]).view(n, k)
    b64 = torch.zeros(n, dtype=torch.float64) if b is None else b.double()
    exact = x.double() @ w.T + b64
    weights = (16 * d.abs()[..., None] * (1 + c / 16) + (m - 16 * d).abs()[..., None]).view(n, k)
    terms = 32 + 2 * blocks + 3
    gamma = terms * FLOAT32_ROUNDOFF / (1 - terms * FLOAT32_ROUNDOFF)
    accumulated = gamma * (x64.abs().view(-1, k) @ weights.T + b64.abs())
    bound = accumulated + BF16_ROUNDOFF * (exact.abs() + accumulated)
    error = (ours.double() - exact).abs()
    assert ours.dtype == torch.bfloat16 and bool((error <= bound).all()), (
        f"{(error / bound).max():.3g}x the bound"
    )


@pytest.mark.parametrize("kind", ["q4_1", "q4_0"])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_four_bit_codes_within_rounding_of_float64(
    kernels: tuple[AmxQGemm, AmxGemm], kind: str, n: int, k: int
) -> None:
    qgemm, _ = kernels
    gen = torch.Generator().manual_seed(n * 7 + k)
    codes = _codes(kind, n, k, gen)
    packed = amx_qgemm.pack(codes)
    assert packed is not None and packed[1]
    b = torch.randn(n, generator=gen).bfloat16() if n % 64 else None
    for m in (1, 5, 16, 17, 32, 33, 50):
        x = torch.randn(m, k, generator=gen).bfloat16()
        assert_within_rounding_of_codes(qgemm.linear(x, packed[0], packed[1], n, b), x, codes, b)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_eight_bit_codes_give_the_bits_of_the_bfloat16_tiles(
    kernels: tuple[AmxQGemm, AmxGemm], n: int, k: int
) -> None:
    qgemm, tiles = kernels
    gen = torch.Generator().manual_seed(n * 7 + k)
    codes = _codes("q8_0", n, k, gen)
    w = codes.dequantize().to(torch.bfloat16)
    packed = amx_qgemm.pack(codes)
    assert packed is not None and not packed[1]
    b = torch.randn(n, generator=gen).bfloat16() if n % 64 else None
    for m in (1, 5, 16, 17, 32):
        x = torch.randn(m, k, generator=gen).bfloat16()
        ours = qgemm.linear(x, packed[0], packed[1], n, b)
        assert_within_rounding(ours, x, w, b)
        assert torch.equal(ours, tiles.linear(x, tiles.pack(w), n, b)), m


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_is_the_same_bits_in_any_batch_and_on_any_threads(
    kernels: tuple[AmxQGemm, AmxGemm], kind: str
) -> None:
    qgemm, _ = kernels
    gen = torch.Generator().manual_seed(3)
    n, k = 576, 1536
    packed, four = amx_qgemm.pack(_codes(kind, n, k, gen)) or pytest.fail("not packed")
    row = torch.randn(1, k, generator=gen).bfloat16()
    alone = qgemm.linear(row, packed, four, n, None)[0]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for m, at in (
                (1, 0),
                (3, 2),
                (16, 9),
                (17, 16),
                (25, 0),
                (32, 31),
                *([(48, 40)] if four else []),
            ):
                x = torch.randn(m, k, generator=gen).bfloat16()
                x[at] = row[0]
                assert torch.equal(qgemm.linear(x, packed, four, n, None)[at], alone), (count, m, at)
    finally:
        torch.set_num_threads(threads)


def test_strided_rows(kernels: tuple[AmxQGemm, AmxGemm]) -> None:
    qgemm, _ = kernels
    gen = torch.Generator().manual_seed(1)
    packed, four = amx_qgemm.pack(_codes("q4_1", 130, 64, gen)) or pytest.fail("not packed")
    wide = torch.randn(20, 100, generator=gen).bfloat16()
    x = wide[:, 10:74]  # rows 100 apart
    expected = qgemm.linear(x.contiguous(), packed, four, 130, None)
    assert torch.equal(qgemm.linear(x, packed, four, 130, None), expected)
    assert torch.equal(qgemm.linear(x.reshape(2, 10, 64), packed, four, 130, None), expected.view(2, 10, 130))


def test_pack_refuses_blocks_it_cannot_take() -> None:
    gen = torch.Generator().manual_seed(2)
    codes = _codes("q4_1", 64, 64, gen)
    # more inputs than the 4-bit kernel's rows' block sums hold
    wide_k = _codes("q4_1", 16, amx_qgemm.MAX_K + BLOCK, gen)
    assert amx_qgemm.pack(wide_k) is None
    # a scale that is not a float16
    scales = codes.scales.clone()
    scales[3, 1] = 1.0 + 2.0**-20
    assert amx_qgemm.pack(BlockCodes(codes.codes, scales, codes.offsets)) is None
    # codes past 4 bits with offsets
    wide = codes.codes.clone()
    wide[0, 0] = 16
    assert amx_qgemm.pack(BlockCodes(wide, codes.scales, codes.offsets)) is None
    assert amx_qgemm.pack(codes) is not None


def test_refuses_what_it_cannot_compute(kernels: tuple[AmxQGemm, AmxGemm]) -> None:
    qgemm, _ = kernels
    packed, four = amx_qgemm.pack(_codes("q8_0", 64, 64, torch.Generator().manual_seed(0))) or pytest.fail()
    with pytest.raises(ValueError, match="at most 32"):
        qgemm.linear(torch.zeros(33, 64, dtype=torch.bfloat16), packed, four, 64, None)
    with pytest.raises(ValueError, match="does not fit"):
        qgemm.linear(torch.zeros(2, 96, dtype=torch.bfloat16), packed, four, 64, None)
    with pytest.raises(ValueError, match="does not fit"):
        qgemm.linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, not four, 64, None)


# ------------------------------------------------------------------ the default model in bfloat16


@pytest.fixture(scope="module")
def bf16_stacks(kernels: tuple[AmxQGemm, AmxGemm]) -> tuple[CpuDecodeStack, CpuDecodeStack]:
    """The default model in bfloat16 as the engine loads it (its Q4_1 and Q8_0 matrices in quantized tiles
    too), and the same file on the bfloat16 tiles alone; each with its decode stack."""
    quantized = load_model("default", dtype="bfloat16", device="cpu").model
    plain = load_model("default", dtype="bfloat16", device="cpu", prepack=False).model
    with torch.no_grad():
        apply_cpu_fast_paths(plain)  # no blocks given
    stacks = CpuDecodeStack.for_model(quantized), CpuDecodeStack.for_model(plain)
    if stacks[0] is None or stacks[1] is None:
        pytest.skip("the decode stack cannot be built here")
    return stacks[0], stacks[1]


@pytest.mark.slow
def test_the_default_model_reads_its_blocks_in_bfloat16(
    bf16_stacks: tuple[CpuDecodeStack, CpuDecodeStack],
) -> None:
    quantized, plain = (stack.model for stack in bf16_stacks)
    linears = [m for m in quantized.modules() if isinstance(m, QuantAmxLinear)]
    assert len(linears) == 4 * quantized.config.num_hidden_layers + 1  # every projection and the tied head
    assert not any(isinstance(m, QuantAmxLinear) for m in plain.modules())
    head = quantized.lm_head
    assert isinstance(head, QuantAmxLinear) and not head.four_bit  # Q8_0
    assert all(m.four_bit for m in linears if m is not head)  # Q4_1
    q_bytes = sum(m.qtiles.numel() for m in linears)
    bf16_bytes = sum(m.rest.tiles.numel() * 2 for m in linears)
    assert q_bytes < bf16_bytes / 2.7, (q_bytes, bf16_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("num_seqs", [1, 16, 17, 48])
def test_the_default_model_in_bfloat16_from_its_blocks(
    bf16_stacks: tuple[CpuDecodeStack, CpuDecodeStack], num_seqs: int
) -> None:
    """Prefill rows: the logits and K/V of the bfloat16 tiles, bit for bit. A decode step: the same bits in
    the decode stack and layer by layer (the codes for every decode row, whatever their number), and
    log-probabilities close to the bfloat16 tiles' (the checkpoint's weights against their roundings to
    bfloat16). Greedy generation: the same tokens batched and chunked."""
    decode_kernel = cpu_kernel_or_skip()
    quantized, plain = bf16_stacks
    cfg = quantized.model.config
    caches = [_cache(cfg) for _ in range(3)]  # the stack's, the bfloat16 tiles', layer by layer's
    prompts = [[(7 * i + 3 * s) % cfg.vocab_size for i in range(3 + 5 * s % 60)] for s in range(num_seqs)]
    tables = [[1 + 8 * s + j for j in range(8)] for s in range(num_seqs)]
    prefill = BatchInputs.build(prompts, [0] * num_seqs, tables, [True] * num_seqs, 16)
    decode = BatchInputs.build([[12 + s] for s in range(num_seqs)], [len(p) for p in prompts], tables,
                               [True] * num_seqs, 16)  # fmt: skip
    first = [
        stack.forward(prefill, cache, decode_kernel)
        for stack, cache in zip(bf16_stacks, caches, strict=False)
    ]
    assert torch.equal(first[0], first[1])
    quantized.model.forward(prefill, caches[2], decode_kernel)
    assert torch.equal(caches[0].kv, caches[1].kv) and torch.equal(caches[0].kv, caches[2].kv)
    assert quantized.can_run(decode, decode_kernel)
    stacked = quantized.forward(decode, caches[0], decode_kernel)
    assert torch.equal(stacked, quantized.model.forward(decode, caches[2], decode_kernel))
    assert torch.equal(caches[0].kv, caches[2].kv)
    tiles = plain.forward(decode, caches[1], decode_kernel)
    p, q = tiles.log_softmax(-1), stacked.log_softmax(-1)  # bfloat16 keeps ~3 digits: distributions, not bits
    kl = (p.exp() * (p - q)).sum(-1)
    assert bool((kl < 0.05).all()), kl
    if num_seqs > 2:
        return
    runs = [
        run_greedy(quantized, _cache(cfg), prompts, 8, mode=mode, decode_kernel=decode_kernel)
        for mode in ("batched", "chunked")
    ]
    assert runs[0] == runs[1]


def _cache(cfg: ModelConfig) -> KVCache:
    return KVCache(cfg.num_hidden_layers, 12 * 40, 16, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16)
