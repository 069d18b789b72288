"""The AVX512-BF16 matmul over a checkpoint's blocks of codes (``Bf16Gemm.pack_blocks`` / ``qlinear``,
csrc/bf16_gemm.c), on CPUs with those dot products (on an AMX CPU its tiles hidden from the loader): the
weights it expands are the loaded bfloat16 weights, so its outputs are the bits of the kernel over the
bfloat16 panels -- for Q4_1, Q4_0 and Q8_0 codes at the model's shapes and at tails, from 1 to 12 rows --
and a row's bits do not depend on the rows beside it; what ``pack_blocks`` refuses. In the default model
(bfloat16): every projection and the head read their blocks, and prefill, decode steps in the decode stack
(1 to 13 sequences: the blocks up to 12) and greedy generation give the bits of the bfloat16 panels
alone."""

from __future__ import annotations

import pytest
import torch
from test_amx_gemm import MODEL_SHAPES
from test_amx_qgemm import KINDS, _codes, assert_same_bits_as_plain

from engine.cpu.native_build import KernelUnavailable
from engine.executor import fast_paths
from engine.executor.decode_stack import CpuDecodeStack
from engine.executor.fast_paths import apply_cpu_fast_paths
from engine.executor.kernels import bf16_gemm
from engine.executor.kernels.bf16_gemm import Bf16Gemm
from engine.executor.kernels.block_codes import BlockCodes
from engine.executor.kernels.modules import QuantBf16PanelLinear
from engine.loader.model_loader import load_model

MAX_ROWS = bf16_gemm.QUANTIZED_MAX_ROWS


@pytest.fixture(scope="module")
def gemm() -> Bf16Gemm:
    try:
        return bf16_gemm.load()
    except KernelUnavailable as e:
        pytest.skip(f"the AVX512-BF16 kernel cannot run here: {e}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("n", "k"), [*MODEL_SHAPES, (100, 64), (150, 64), (49152 // 16, 576)])
def test_the_bits_of_the_bfloat16_panels(gemm: Bf16Gemm, kind: str, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 7 + k)
    codes = _codes(kind, n, k, gen)
    w = codes.dequantize().to(torch.bfloat16)
    packed = gemm.pack_blocks(codes)
    assert packed is not None and packed[1] == (kind != "q8_0")
    panels = gemm.pack(w)
    b = torch.randn(n, generator=gen).bfloat16() if n % 64 else None
    for m in (1, 2, 5, 8, 11, MAX_ROWS):
        x = torch.randn(m, k, generator=gen).bfloat16()
        ours = gemm.qlinear(x, packed[0], packed[1], n, b)
        assert torch.equal(ours, gemm.linear(x, panels, n, b)), m
        widened = gemm.qlinear(x, packed[0], packed[1], n, b, torch.float32)
        assert widened.dtype == torch.float32 and torch.equal(widened, ours.float()), m


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_is_the_same_bits_in_any_batch(gemm: Bf16Gemm, kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    n, k = 576, 1536
    packed, four = gemm.pack_blocks(_codes(kind, n, k, gen)) or pytest.fail("not packed")
    row = torch.randn(1, k, generator=gen).bfloat16()
    alone = gemm.qlinear(row, packed, four, n, None)[0]
    for m, at in ((1, 0), (3, 2), (7, 6), (8, 0), (MAX_ROWS, MAX_ROWS - 1)):
        x = torch.randn(m, k, generator=gen).bfloat16()
        x[at] = row[0]
        assert torch.equal(gemm.qlinear(x, packed, four, n, None)[at], alone), (m, at)


def test_pack_blocks_refuses_blocks_it_cannot_give_exactly(gemm: Bf16Gemm) -> None:
    codes = _codes("q4_1", 64, 64, torch.Generator().manual_seed(2))
    scales = codes.scales.clone()
    scales[3, 1] = 1.0 + 2.0**-20  # not a float16: a code times it is not exact in float32
    assert gemm.pack_blocks(BlockCodes(codes.codes, scales, codes.offsets)) is None
    wide = codes.codes.clone()
    wide[0, 0] = 16  # past 4 bits, with offsets
    assert gemm.pack_blocks(BlockCodes(wide, codes.scales, codes.offsets)) is None
    assert gemm.pack_blocks(codes) is not None
    packed, four = gemm.pack_blocks(codes) or pytest.fail()
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS}"):
        gemm.qlinear(torch.zeros(MAX_ROWS + 1, 64, dtype=torch.bfloat16), packed, four, 64, None)
    with pytest.raises(ValueError, match="do not fit"):
        gemm.qlinear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, not four, 64, None)


# ------------------------------------------------------------------ the default model in bfloat16


@pytest.fixture(scope="module")
def bf16_stacks(gemm: Bf16Gemm) -> tuple[CpuDecodeStack, CpuDecodeStack]:
    """The default model in bfloat16 as the engine loads it on a CPU without AMX (its Q4_1 and Q8_0 matrices
    as blocks too), and the same file on the bfloat16 panels alone; each with its decode stack."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_paths, "_amx", lambda model: None)
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
    linears = [m for m in quantized.modules() if isinstance(m, QuantBf16PanelLinear)]
    assert len(linears) == 4 * quantized.config.num_hidden_layers + 1  # every projection and the tied head
    assert not any(isinstance(m, QuantBf16PanelLinear) for m in plain.modules())
    head = quantized.lm_head
    assert isinstance(head, QuantBf16PanelLinear) and not head.four_bit  # Q8_0
    assert all(m.four_bit for m in linears if m is not head)  # Q4_1
    q_bytes = sum(m.qpanels.numel() for m in linears)
    bf16_bytes = sum(m.rest.panels.numel() * 2 for m in linears)
    assert q_bytes < bf16_bytes / 2.2, (q_bytes, bf16_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("num_seqs", [1, 7, MAX_ROWS + 1])
def test_the_default_model_computes_the_same_bits_in_bfloat16(
    bf16_stacks: tuple[CpuDecodeStack, CpuDecodeStack], num_seqs: int
) -> None:
    """Prefill, decode steps in the decode stack (from the blocks up to 12 sequences) and the output head:
    the logits and K/V of the bfloat16 panels, bit for bit; then greedy generation, batched and chunked."""
    assert_same_bits_as_plain(*bf16_stacks, num_seqs)
