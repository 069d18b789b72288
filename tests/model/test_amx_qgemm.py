"""The bfloat16 AMX matmul over a checkpoint's blocks of codes (engine/executor/kernels/amx_qgemm.py), where
the CPU has AMX-BF16: the weights it expands are the loaded bfloat16 weights (block_codes.py's float32
weights rounded to nearest even) -- so it is within float32-accumulation rounding of a float64 reference
over them, and its outputs are the bits of the AMX kernel over the same bfloat16 weights (the property the
model's batch invariance rests on: decode rows read the blocks, prefill chunks the bfloat16 tiles) -- for
Q4_1, Q4_0 and Q8_0 codes at the model's shapes and at tails, from 1 to 32 rows; a row's bits do not depend
on the rows beside it nor on the threads; what ``pack`` refuses; argument checks. In the default model
(bfloat16): every projection and the head read their blocks, and prefill, decode steps in the decode stack
(1 to 33 sequences) and greedy generation give the bits of the bfloat16 tiles alone."""

from __future__ import annotations

import pytest
import torch
from model_harness import cpu_kernel_or_skip, run_greedy
from test_amx_gemm import MODEL_SHAPES, assert_within_rounding

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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_the_bits_of_the_bfloat16_tiles_within_rounding_of_float64(
    kernels: tuple[AmxQGemm, AmxGemm], kind: str, n: int, k: int
) -> None:
    qgemm, tiles = kernels
    gen = torch.Generator().manual_seed(n * 7 + k)
    codes = _codes(kind, n, k, gen)
    w = codes.dequantize().to(torch.bfloat16)
    packed = amx_qgemm.pack(codes)
    assert packed is not None and packed[1] == (kind != "q8_0")
    b = torch.randn(n, generator=gen).bfloat16() if n % 64 else None
    for m in (1, 5, 16, 17, 32):
        x = torch.randn(m, k, generator=gen).bfloat16()
        ours = qgemm.linear(x, packed[0], packed[1], n, b)
        assert_within_rounding(ours, x, w, b)
        assert torch.equal(ours, tiles.linear(x, tiles.pack(w), n, b)), m
        widened = qgemm.linear(x, packed[0], packed[1], n, b, torch.float32)  # written as float32 by the kernel
        assert widened.dtype == torch.float32 and torch.equal(widened, ours.float()), m


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
            for m, at in ((1, 0), (3, 2), (16, 9), (17, 16), (25, 0), (32, 31)):
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


def test_pack_refuses_blocks_it_cannot_give_exactly() -> None:
    gen = torch.Generator().manual_seed(2)
    codes = _codes("q4_1", 64, 64, gen)
    # an offset far below its scale: m - 128 d needs more than float32's 24 bits
    far = codes.offsets.clone()
    far[0, 0] = 2.0**-20
    assert amx_qgemm.pack(BlockCodes(codes.codes, codes.scales, far)) is None
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
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        qgemm.linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, four, 64, None, torch.float16)


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
@pytest.mark.parametrize("num_seqs", [1, 16, 17, amx_qgemm.MAX_ROWS + 1])
def test_the_default_model_computes_the_same_bits_in_bfloat16(
    bf16_stacks: tuple[CpuDecodeStack, CpuDecodeStack], num_seqs: int
) -> None:
    """Prefill, decode steps in the decode stack (from the quantized tiles up to 32 sequences) and the
    output head: the logits and K/V of the bfloat16 tiles, bit for bit; then greedy generation, batched and
    chunked."""
    assert_same_bits_as_plain(*bf16_stacks, num_seqs)


def assert_same_bits_as_plain(quantized: CpuDecodeStack, plain: CpuDecodeStack, num_seqs: int) -> None:
    """``num_seqs`` prompts' prefill and decode step give ``plain``'s logits and K/V bit for bit on
    ``quantized`` (the same checkpoint with its blocks); up to two, greedy generation too, batched and
    chunked (tests/model/test_bf16_qgemm.py runs it on the AVX512-BF16 kernel)."""
    decode_kernel = cpu_kernel_or_skip()
    cfg = quantized.model.config
    caches = [_cache(cfg) for _ in range(2)]
    prompts = [[(7 * i + 3 * s) % cfg.vocab_size for i in range(3 + 5 * s)] for s in range(num_seqs)]
    tables = [[1 + 12 * s + j for j in range(12)] for s in range(num_seqs)]
    prefill = BatchInputs.build(prompts, [0] * num_seqs, tables, [True] * num_seqs, 16)
    decode = BatchInputs.build([[12 + s] for s in range(num_seqs)], [len(p) for p in prompts], tables,
                               [True] * num_seqs, 16)  # fmt: skip
    for batch in (prefill, decode):
        out_q = quantized.forward(batch, caches[0], decode_kernel)
        assert torch.equal(out_q, plain.forward(batch, caches[1], decode_kernel))
    assert torch.equal(caches[0].kv, caches[1].kv)
    if num_seqs > 2:
        return
    for mode in ("batched", "chunked"):
        runs = [
            run_greedy(model, _cache(cfg), prompts, 8, mode=mode, decode_kernel=decode_kernel)
            for model in (quantized, plain)
        ]
        assert runs[0] == runs[1]


def _cache(cfg: ModelConfig) -> KVCache:
    return KVCache(cfg.num_hidden_layers, 12 * 40, 16, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16)
