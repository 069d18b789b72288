"""The CPU fast paths as module swaps (engine/executor/fast_paths.py, engine/executor/kernels/modules.py):
which module takes each Linear, norm, rotary and activation per dtype and CPU; that each kernel module
routes its calls as documented (the small kernel for few rows, oneDNN for more, or the kernel for all where
it takes every batch; the MLP's projection and gate in one AMX call, with the same bits); and that a swapped
model's logits are the plain model's up to float rounding."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu.native_build import KernelUnavailable
from engine.executor import fast_paths
from engine.executor.fast_paths import apply_cpu_fast_paths
from engine.executor.inputs import BatchInputs
from engine.executor.kernels import amx_gemm, bf16_gemm, prepacked, small_gemm
from engine.executor.kernels.modules import (
    AmxLinear,
    Bf16PanelLinear,
    FusedRMSNorm,
    FusedRotaryEmbedding,
    FusedSiLUMul,
    FusedSwiGLUMLP,
    PackedLinear,
    SmallGemmLinear,
    WidenedLinear,
)
from engine.executor.kernels.small_gemm import SmallGemm
from engine.executor.kv_cache import KVCache
from engine.executor.models import LlamaForCausalLM, build_model
from engine.executor.models.layers import GatedMLP, Linear, RMSNorm, SiluAndMul
from engine.loader.dummy import get_preset

CPU = torch.device("cpu")
TINY = dataclasses.replace(get_preset("smollm2-135m"), vocab_size=200, hidden_size=64, intermediate_size=160,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip


@pytest.fixture(scope="module")
def kernel() -> SmallGemm:
    try:
        return small_gemm.load()
    except KernelUnavailable as e:
        pytest.skip(f"the small-batch matmul kernel cannot be built here: {e}")


def _pair(dtype: torch.dtype) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """Two copies of TINY with the same random weights."""
    model, plain = build_model(TINY, dtype, CPU), build_model(TINY, dtype, CPU)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            q.copy_(p)
    return model, plain


def _types(model: nn.Module, kind: type[nn.Module]) -> set[type[nn.Module]]:
    """The types of the modules that took the place of ``kind``'s (its attribute names in a plain model)."""
    plain = build_model(TINY, torch.float32, CPU)
    names = {name for name, m in plain.named_modules() if type(m) is kind}
    return {type(m) for name, m in model.named_modules() if name in names}


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_float32_model_gets_the_kernels_modules(kernel: SmallGemm, batch_invariant: bool) -> None:
    if not prepacked.can_prepack(CPU, torch.float32):
        pytest.skip("this torch build cannot prepack weights (no oneDNN)")
    model, _ = _pair(torch.float32)
    paths = apply_cpu_fast_paths(model, batch_invariant=batch_invariant)
    assert paths.prepacked and paths.small_gemm is not None
    assert _types(model, Linear) == {SmallGemmLinear}
    head = model.lm_head
    assert isinstance(head, SmallGemmLinear)
    # calls of every size on the panels, with or without the flag: no oneDNN copy of a weight
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert paths.batch_invariant
    if paths.fused_ops is None:
        pytest.skip("the fused CPU ops cannot be built here")
    assert _types(model, RMSNorm) == {FusedRMSNorm}
    assert _types(model, SiluAndMul) == {FusedSiLUMul}
    assert isinstance(model.rotary, FusedRotaryEmbedding)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_bfloat16_model_gets_onednn_or_the_amx_or_dot_kernel_and_the_fused_ops(
    batch_invariant: bool,
) -> None:
    model, _ = _pair(torch.bfloat16)
    paths = apply_cpu_fast_paths(model, batch_invariant=batch_invariant)
    onednn = prepacked.can_prepack(CPU, torch.bfloat16)
    amx = onednn and amx_gemm.load.available()
    dot = not amx and bf16_gemm.load.available()  # AVX512-BF16 without AMX
    widened = batch_invariant and not (amx or dot) and paths.small_gemm is not None  # AVX2: float32 chains
    assert paths.small_gemm is None or widened  # else the small kernel is float32 only
    assert paths.prepacked == (onednn or dot or widened)
    expected = (
        AmxLinear
        if amx
        else Bf16PanelLinear
        if dot
        else WidenedLinear
        if widened
        else PackedLinear
        if onednn
        else Linear
    )
    assert _types(model, Linear) == {expected}
    # the tiles and the dot kernel's panels take every call, with or without the flag
    assert paths.batch_invariant == (amx or dot or widened)
    if amx or dot:
        head = cast(AmxLinear | Bf16PanelLinear, model.lm_head)
        assert head.takes(1) and head.takes(8192)
        assert not any(isinstance(m, PackedLinear) for m in model.modules())  # no oneDNN copy of a weight
    if paths.fused_ops is not None:
        assert _types(model, RMSNorm) == {FusedRMSNorm} and isinstance(model.rotary, FusedRotaryEmbedding)
    # the MLP's projection and gate in one AMX call where both are swapped in
    fused_mlp = (amx or dot) and paths.fused_ops is not None
    assert _types(model, GatedMLP) == {FusedSwiGLUMLP if fused_mlp else GatedMLP}


def test_bfloat16_on_avx2_is_batch_invariant_on_float32_chains(
    kernel: SmallGemm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a CPU without AMX-BF16 and AVX512-BF16 runs with ``batch_invariant`` (those kernels hidden here
    where it has them): each projection in float32 over the bfloat16 weights, rounded once -- a float64
    reference's output rounded to bfloat16 within one bfloat16 step -- and a row's bits the same alone and
    among 300 rows."""
    monkeypatch.setattr(fast_paths, "_amx", lambda model: None)
    monkeypatch.setattr(fast_paths, "_bf16_dot", lambda model: None)
    model, plain = _pair(torch.bfloat16)
    paths = apply_cpu_fast_paths(model, batch_invariant=True)
    assert paths.batch_invariant and _types(model, Linear) == {WidenedLinear}
    layer, plain_layer = model.model.layers[0].mlp.gate_up_proj, plain.model.layers[0].mlp.gate_up_proj
    x = torch.randn(300, TINY.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (300, 2 * TINY.intermediate_size)
    reference = (x.double() @ plain_layer.weight.double().T).to(torch.bfloat16)
    step = reference.float().abs() * 2.0**-7 + 1e-30  # one bfloat16 step at the reference's magnitude
    assert bool(((out.float() - reference.float()).abs() <= step).all())
    for row in (0, 151, 299):
        assert torch.equal(layer(x[row : row + 1]), out[row : row + 1])


def test_bfloat16_weights_the_tiles_cannot_pack_take_the_dot_kernel_or_float32_chains_when_invariant(
    kernel: SmallGemm,
) -> None:
    """A K that is not a multiple of 32 (the down projection of 168 inputs): no AMX tiles for the model, so
    every projection takes the AVX512-BF16 kernel's panels where the CPU has it (flag or not), else with
    ``batch_invariant`` the float32 chains."""
    model = build_model(dataclasses.replace(TINY, intermediate_size=168), torch.bfloat16, CPU)
    paths = apply_cpu_fast_paths(model, batch_invariant=True)
    assert paths.batch_invariant
    kinds = WidenedLinear | Linear | AmxLinear | Bf16PanelLinear
    projections = {type(m) for m in model.modules() if isinstance(m, kinds)}
    assert projections == {Bf16PanelLinear if bf16_gemm.load.available() else WidenedLinear}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_swapped_model_gives_the_plain_models_logits(dtype: torch.dtype) -> None:
    """Prefill (more rows than the small kernel takes) and a decode step, SDPA attention: the same logits
    up to float rounding (bfloat16: its ~3 significant digits)."""
    model, plain = _pair(dtype)
    apply_cpu_fast_paths(model)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.05)
    caches = [KVCache(TINY.num_hidden_layers, 16, 16, TINY.num_key_value_heads, TINY.head_dim, dtype, CPU) for _ in range(2)]  # fmt: skip
    prompts, tables = [list(range(5, 75)), [9, 10, 11]], [[1, 3, 4, 5, 6], [2]]  # 73 prefill rows
    prefill = BatchInputs.build(prompts, [0, 0], tables, [True, True], 16)
    decode = BatchInputs.build([[12], [13]], [70, 3], tables, [True, True], 16)
    for batch in (prefill, decode):
        torch.testing.assert_close(model(batch, caches[0]), plain(batch, caches[1]), **tol)  # type: ignore[arg-type]


@pytest.mark.parametrize("rows", [1, 12, 13, 32, 33, 64, 65, 300])
def test_the_fused_swiglu_mlp_gives_the_bits_of_its_modules(rows: int) -> None:
    """``FusedSwiGLUMLP``: its one call for more rows than read the blocks (AMX: 32, AVX512-BF16: 12), and
    its modules for fewer, give the bits of the swapped modules run one after another
    (``GatedMLP.forward``)."""
    model, _ = _pair(torch.bfloat16)
    apply_cpu_fast_paths(model)
    mlp = model.model.layers[0].mlp
    if not isinstance(mlp, FusedSwiGLUMLP):
        pytest.skip("no AMX tiles, AVX512-BF16 panels or fused ops here")
    x = torch.randn(rows, TINY.hidden_size, generator=torch.Generator().manual_seed(rows)).bfloat16()
    with torch.no_grad():
        assert torch.equal(mlp(x).view(torch.int16), GatedMLP.forward(mlp, x).view(torch.int16))


def _loaded_weights() -> tuple[torch.Tensor, torch.Tensor]:
    """A 32 -> 48 weight and bias."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)


def _count_kernel_calls(kernel: SmallGemm, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of every ``kernel.linear`` call from now on."""
    calls: list[int] = []
    real = kernel.linear

    def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(kernel, "linear", counted)
    return calls


def test_every_call_goes_to_the_kernel(kernel: SmallGemm, monkeypatch: pytest.MonkeyPatch) -> None:
    """The module keeps only the panels and serves any row count (a prefill's too), 3-D inputs and strided
    ones."""
    w, b = _loaded_weights()
    lin = SmallGemmLinear(kernel, w, b)
    calls = _count_kernel_calls(kernel, monkeypatch)
    for x in (torch.randn(1, 32), torch.randn(300, 32), torch.randn(3, 5, 32), torch.randn(32, 7).T):
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert calls == [1, 300, 15, 7]


def test_model_logits_on_the_kernel(kernel: SmallGemm) -> None:
    """A float32 model runs every matmul on the kernel, its output head's too: prefill (more rows than
    MAX_ROWS) and decode logits equal the dense model's up to float rounding."""
    if not prepacked.can_prepack(CPU, torch.float32):
        pytest.skip("this torch build cannot prepack weights (no oneDNN)")
    model, dense = _pair(torch.float32)
    assert apply_cpu_fast_paths(model).small_gemm is not None
    assert isinstance(model.lm_head, SmallGemmLinear)
    cfg = TINY
    cache = KVCache(cfg.num_hidden_layers, 16, 16, cfg.num_key_value_heads, cfg.head_dim, torch.float32, CPU)
    dense_cache = KVCache(
        cfg.num_hidden_layers, 16, 16, cfg.num_key_value_heads, cfg.head_dim, torch.float32, CPU
    )
    prompts = [list(range(5, 75)), [9, 10, 11]]  # 73 prefill rows: more than MAX_ROWS
    prefill = BatchInputs.build(prompts, [0, 0], [[1, 3, 4, 5, 6], [2]], [True, True], 16)
    torch.testing.assert_close(model(prefill, cache), dense(prefill, dense_cache), rtol=1e-4, atol=1e-4)
    decode = BatchInputs.build([[12], [13]], [70, 3], [[1, 3, 4, 5, 6], [2]], [True, True], 16)
    torch.testing.assert_close(model(decode, cache), dense(decode, dense_cache), rtol=1e-4, atol=1e-4)
