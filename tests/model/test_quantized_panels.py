"""Block-quantized panels of the small-batch kernel (engine/executor/kernels/small_gemm.py, pack_blocks): a matmul over
a GGUF's Q4_0/Q4_1/Q8_0 blocks gives the bits of the float32 panels of the dequantized weights, in the kernel
(any row count), in the decode stack and in the default model (steps of a few sequences), from a third to a
quarter of the bytes."""

from __future__ import annotations

import pytest
import torch
from model_harness import cpu_kernel_or_skip, run_greedy

from engine.cpu.native_build import KernelUnavailable
from engine.executor.decode_stack import CpuDecodeStack
from engine.executor.fast_paths import apply_cpu_fast_paths
from engine.executor.inputs import BatchInputs
from engine.executor.kernels.block_codes import BLOCK, BlockCodes
from engine.executor.kernels.modules import QuantPanelLinear, SmallGemmLinear
from engine.executor.kernels.small_gemm import PANEL, QUANTIZED_MAX_ROWS, SmallGemm, load, qblock_bytes
from engine.executor.kv_cache import KVCache
from engine.executor.models import LlamaForCausalLM
from engine.loader.model_loader import LoadedModel, load_model

pytestmark = pytest.mark.slow  # the real model's quantized blocks, step by step

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel() -> SmallGemm:
    try:
        return load()
    except KernelUnavailable as e:
        pytest.skip(f"the small-batch kernel cannot be built here: {e}")


def random_codes(n: int, k: int, offsets: bool, seed: int = 0) -> BlockCodes:
    """Codes over the whole int8 range (Q8_0) or 0..15 (Q4_1); scales and offsets float16 values of both
    signs, zero included (a zero code times a negative scale is -0.0)."""
    gen = torch.Generator().manual_seed(seed)
    low, high = (0, 16) if offsets else (-128, 128)
    codes = torch.randint(low, high, (n, k), generator=gen, dtype=torch.int8)

    def halves() -> torch.Tensor:
        t = (torch.randn(n, k // BLOCK, generator=gen) * 0.05).half().float()
        t[0, 0] = 0.0
        return t

    return BlockCodes(codes, halves(), halves() if offsets else None)


@pytest.mark.parametrize("offsets", [False, True], ids=["d*q", "d*q+m"])
@pytest.mark.parametrize(("n", "k"), [(16, 32), (40, 64), (960, 576), (24, 1536)])
@pytest.mark.parametrize("m", [1, 5, 16, 17, 64, 130])
def test_same_bits_as_the_float32_panels(kernel: SmallGemm, offsets: bool, n: int, k: int, m: int) -> None:
    codes = random_codes(n, k, offsets, seed=n + k + m)
    weight = codes.dequantize()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n)
    qpacked = kernel.pack_blocks(codes)
    assert qpacked.dtype == torch.uint8 and qpacked.shape == SmallGemm.qpacked_shape(n, k, offsets)
    for b in (None, bias):
        expected = kernel.linear(x, kernel.pack(weight), n, b)
        assert torch.equal(kernel.linear(x, qpacked, n, b), expected)
    product = kernel.matmul(x.view(m, 1, k), qpacked, n, None).view(m, n)
    torch.testing.assert_close(product, x @ weight.T, rtol=1e-4, atol=1e-3)


def test_dequantize_has_one_rounding() -> None:
    """scale * code (+ offset) computed exactly (float64) and rounded once to float32: the kernel may expand
    a weight with a fused multiply-add or with a multiply and an add and get these bits either way."""
    codes = random_codes(64, 256, offsets=True, seed=3)
    exact = codes.codes.double().view(64, 8, BLOCK) * codes.scales.double().unsqueeze(-1)
    assert codes.offsets is not None
    exact += codes.offsets.double().unsqueeze(-1)
    assert torch.equal(codes.dequantize(), exact.float().view(64, 256))


def test_pack_blocks_layout(kernel: SmallGemm) -> None:
    codes = random_codes(40, 96, offsets=True, seed=1)
    packed = kernel.pack_blocks(codes)
    assert packed.shape == (3, 3, qblock_bytes(True)) == (3, 3, BLOCK * PANEL + 2 * PANEL * 4)
    for row, col in [(0, 0), (17, 33), (39, 95), (31, 64)]:
        p, j, b, kk = row // PANEL, row % PANEL, col // BLOCK, col % BLOCK
        assert packed[p, b, kk * PANEL + j].view(torch.int8) == codes.codes[row, col]
        scale = packed[p, b, BLOCK * PANEL + 4 * j : BLOCK * PANEL + 4 * j + 4].view(torch.float32)
        offset = packed[p, b, BLOCK * PANEL + 4 * PANEL + 4 * j : BLOCK * PANEL + 4 * PANEL + 4 * j + 4]
        assert scale.item() == codes.scales[row, b].item()
        assert codes.offsets is not None and offset.view(torch.float32).item() == codes.offsets[row, b].item()
    assert not packed[2, :, : BLOCK * PANEL].view(3, BLOCK, PANEL)[:, :, 8:].any()  # outputs 40..47: padding


def test_bad_shapes_are_refused(kernel: SmallGemm) -> None:
    qpacked = kernel.pack_blocks(random_codes(16, 64, offsets=False))
    with pytest.raises(ValueError, match="does not fit"):
        kernel.linear(torch.randn(2, 32), qpacked, 16, None)  # K differs
    with pytest.raises(ValueError, match="does not fit"):
        kernel.linear(torch.randn(2, 64), qpacked, 17, None)  # more outputs than the panels hold
    with pytest.raises(ValueError, match="multiple of 32"):
        BlockCodes(torch.zeros(4, 40, dtype=torch.int8), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="scales must be float32"):
        BlockCodes(torch.zeros(4, 64, dtype=torch.int8), torch.zeros(4, 3))


def test_cat_refuses_mixed_kinds() -> None:
    a, b = random_codes(16, 64, offsets=True), random_codes(16, 64, offsets=False)
    assert BlockCodes.cat([a, b]) is None
    joined = BlockCodes.cat([a, a])
    assert joined is not None and torch.equal(joined.dequantize(), torch.cat([a.dequantize()] * 2))


# ------------------------------------------------------------------ the default model


@pytest.fixture(scope="module")
def models(kernel: SmallGemm, default_model: LoadedModel) -> tuple[CpuDecodeStack, CpuDecodeStack]:
    """The default model as the engine loads it (the session's load: its Q4_1 and Q8_0 matrices in quantized
    panels too), and the same file with float32 panels only; each with its decode stack, as the engine runs
    them."""
    quantized = default_model.model
    plain = load_model("default", dtype="float32", device="cpu", prepack=False).model
    assert isinstance(quantized, LlamaForCausalLM) and isinstance(plain, LlamaForCausalLM)
    with torch.no_grad():
        apply_cpu_fast_paths(plain)
    stacks = CpuDecodeStack.for_model(quantized), CpuDecodeStack.for_model(plain)
    if stacks[0] is None or stacks[1] is None:
        pytest.skip("the decode stack cannot be built here")
    return stacks[0], stacks[1]


def test_the_default_model_keeps_its_blocks(models: tuple[CpuDecodeStack, CpuDecodeStack]) -> None:
    quantized, plain = (stack.model for stack in models)
    swapped = [m for m in quantized.modules() if isinstance(m, QuantPanelLinear | SmallGemmLinear)]
    linears = [m for m in swapped if isinstance(m, QuantPanelLinear)]
    assert (
        len(swapped) == 2 * len(linears) > 0
    )  # every projection keeps its blocks (float32 panels behind them)
    assert all(m.qpanels.dtype == torch.uint8 for m in linears)
    assert not any(isinstance(m, QuantPanelLinear) for m in plain.modules())
    # every projection is Q4_1 (d * q + m), the tied output head Q8_0 (d * q)
    head = quantized.lm_head
    assert isinstance(head, QuantPanelLinear) and head.qpanels.shape[-1] == qblock_bytes(False)
    assert {m.qpanels.shape[-1] for m in linears if m is not head} == {qblock_bytes(True)}
    q_bytes = sum(m.qpanels.numel() for m in linears)
    f_bytes = sum(m.rest.panels.numel() * 4 for m in linears)
    assert q_bytes < f_bytes / 3.2, (q_bytes, f_bytes)


@pytest.mark.parametrize("num_seqs", [1, 2, QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS + 1])
def test_the_default_model_computes_the_same_bits(
    models: tuple[CpuDecodeStack, CpuDecodeStack], num_seqs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill, decode steps in the decode stack (from the quantized panels up to QUANTIZED_MAX_ROWS
    sequences) and the output head: equal logits and K/V; then greedy generation, batched and chunked."""
    decode_kernel = cpu_kernel_or_skip()
    quantized, plain = models
    cfg = quantized.model.config
    head = quantized.model.lm_head
    assert isinstance(head, QuantPanelLinear)
    calls = _count_quantized_calls(head.rest.small, monkeypatch)
    caches = [KVCache(cfg.num_hidden_layers, 64, 16, cfg.num_key_value_heads, cfg.head_dim) for _ in range(2)]
    prompts = [[(7 * i + 3 * s) % cfg.vocab_size for i in range(3 + 11 * s)] for s in range(num_seqs)]
    tables = [[1 + 6 * s + j for j in range(6)] for s in range(num_seqs)]
    prefill = BatchInputs.build(prompts, [0] * num_seqs, tables, [True] * num_seqs, 16)
    decode = BatchInputs.build([[12 + s] for s in range(num_seqs)], [len(p) for p in prompts], tables,
                               [True] * num_seqs, 16)  # fmt: skip
    quantized_calls = []
    for batch in (prefill, decode):
        calls.clear()
        out_q = quantized.forward(batch, caches[0], decode_kernel)
        quantized_calls.append(list(calls))
        out_f = plain.forward(batch, caches[1], decode_kernel)
        assert torch.equal(out_q, out_f)
    assert torch.equal(caches[0].kv, caches[1].kv)
    if num_seqs == 1:  # a prefill of 3 tokens: every projection of the 30 layers and the head's one row
        assert len(quantized_calls[0]) == 4 * cfg.num_hidden_layers + 1 and max(quantized_calls[0]) == 3
    # the decode step's output head (the layers run in the decode stack, in C)
    assert quantized_calls[1] == ([num_seqs] if num_seqs <= QUANTIZED_MAX_ROWS else [])
    for mode in ("batched", "chunked"):
        runs = [
            run_greedy(
                model,
                KVCache(cfg.num_hidden_layers, 64, 16, cfg.num_key_value_heads, cfg.head_dim),
                prompts,
                8,
                mode=mode,
                decode_kernel=decode_kernel,
            )  # fmt: skip
            for model in (quantized, plain)
        ]
        assert runs[0] == runs[1]


def _count_quantized_calls(small: SmallGemm, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Row counts of the calls of ``small.linear`` on quantized panels, from now on."""
    calls: list[int] = []
    original = small.linear

    def counting(x: torch.Tensor, packed: torch.Tensor, *args: object) -> torch.Tensor:
        if packed.dtype == torch.uint8:
            calls.append(x.shape[0])
        return original(x, packed, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(small, "linear", counting)
    return calls
