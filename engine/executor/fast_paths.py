"""The CPU's fast paths, applied to a loaded model by swapping its modules (engine/executor/kernels/modules.py),
as gpt-fast's ``replace_linear_int4`` does: the model's code stays the architecture alone.

    apply_cpu_fast_paths(model, blocks):
        every Linear (the output head included) ->
            float32, the small kernel built:  SmallGemmLinear for every call, wrapped in a
                                              QuantPanelLinear where the checkpoint's blocks give W exactly
            bfloat16, AMX:                    AmxLinear for every call (every K a multiple of 32; else as
                                              below), wrapped in a QuantAmxLinear where the checkpoint's
                                              blocks round to W exactly
            bfloat16, AVX512-BF16 (no AMX):  Bf16PanelLinear for every call (every K), wrapped in a
                                              QuantBf16PanelLinear where the checkpoint's blocks round to W
            bfloat16, AVX2, batch_invariant: WidenedLinear (float32 on the small kernel's panels)
            otherwise, where oneDNN packs:    PackedLinear
        RMSNorm -> FusedRMSNorm, RotaryEmbedding -> FusedRotaryEmbedding, SiluAndMul -> FusedSiLUMul,
        GeluTanhAndMul -> FusedGeluTanhMul
            (float32 or bfloat16 on the CPU, where the ops could be built)
        GatedMLP (SiLU, its gate and up weight on AMX tiles or AVX512-BF16 panels) -> FusedSwiGLUMLP

Nothing is swapped where the CPU, the dtype or the torch build does not allow it, and a kernel that cannot
be built is logged and skipped: the PyTorch modules run instead. Why each is faster: the modules' files and
docs/MODEL.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from engine.cpu import huge_pages
from engine.cpu.native_build import KernelUnavailable
from engine.executor.kernels import amx_gemm, amx_qgemm, bf16_gemm, cpu_ops, prepacked, small_gemm
from engine.executor.kernels.amx_gemm import AmxGemm
from engine.executor.kernels.amx_qgemm import AmxQGemm
from engine.executor.kernels.bf16_gemm import Bf16Gemm
from engine.executor.kernels.block_codes import BlockCodes
from engine.executor.kernels.cpu_ops import CpuOps
from engine.executor.kernels.modules import (
    AmxLinear,
    Bf16PanelLinear,
    FusedGeluTanhMul,
    FusedRMSNorm,
    FusedRotaryEmbedding,
    FusedSiLUMul,
    FusedSwiGLUMLP,
    PackedLinear,
    QuantAmxLinear,
    QuantBf16PanelLinear,
    QuantPanelLinear,
    SmallGemmLinear,
    WidenedLinear,
)
from engine.executor.kernels.small_gemm import SmallGemm
from engine.executor.models.layers import (
    GatedMLP,
    GeluTanhAndMul,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
)
from engine.executor.models.registry import NativeModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuFastPaths:
    """What ``apply_cpu_fast_paths`` swapped in: the matmuls' kernels and the fused ops (None: not used)."""

    prepacked: bool  # every Linear replaced (PackedLinear and/or SmallGemmLinear)
    small_gemm: SmallGemm | None
    fused_ops: CpuOps | None
    # every Linear computes a row with one kernel whatever else its call holds (small_gemm.c, amx_gemm.c):
    # a row's bits do not depend on its batch
    batch_invariant: bool = False


def apply_cpu_fast_paths(
    model: NativeModel, blocks: Mapping[str, BlockCodes] | None = None, batch_invariant: bool = False
) -> CpuFastPaths:
    """Swap the CPU kernels' modules into ``model`` after ``load_weights`` (which cannot run afterwards: the
    dense projections are freed; the embedding stays dense). ``blocks``: the checkpoint's block-quantized
    tensors by Hugging Face name (the GGUF loader's), kept as quantized panels where they give the loaded
    weight bit for bit. ``batch_invariant``: matmuls of every size on cbserve's kernels, never on oneDNN
    (whose kernel, and rounding, depend on the call's row count): float32 takes the small kernel for every
    call and bfloat16 on a CPU with AMX-BF16 the AMX kernel, else with AVX512-BF16 the dot-product kernel, with
    or without the flag; bfloat16 on an AVX2 CPU, with the flag, float32 chains on the small kernel over the
    bfloat16 weights."""
    small, invariant = swap_linears(model, blocks or {}, batch_invariant)
    ops = swap_fused_ops(model)
    swap_swiglu_mlps(model)
    return CpuFastPaths(not any(isinstance(m, Linear) for m in model.modules()), small, ops, invariant)


def swap_linears(
    model: NativeModel, blocks: Mapping[str, BlockCodes], batch_invariant: bool = False
) -> tuple[SmallGemm | None, bool]:
    """Every ``Linear`` replaced where cbserve's bfloat16 kernels (AMX, AVX512-BF16) take them, where oneDNN
    can prepack this dtype, or where a bfloat16 model must be batch-invariant (else none is); returns the
    small kernel where it serves them, and whether every row takes one kernel whatever its batch."""
    amx = _amx(model) if prepacked.can_prepack(model.device, model.dtype) else None
    if amx is not None and _tiles_fit(model):  # bfloat16 on AMX tiles, every call
        return None, swap_amx_linears(model, amx, blocks)
    dot = _bf16_dot(model)
    if dot is not None:  # bfloat16 without AMX (or a K the tiles do not take): AVX512-BF16, every call
        return None, swap_bf16_panel_linears(model, dot, blocks)
    if batch_invariant and model.dtype == torch.bfloat16 and model.device.type == "cpu":  # AVX2 only
        return swap_widened_linears(model)
    if not prepacked.can_prepack(model.device, model.dtype):
        return None, False
    small: SmallGemm | None = None
    if small_gemm.supports(model.device, model.dtype):
        try:
            small = small_gemm.load()
        except KernelUnavailable as e:
            logger.warning("the small-batch matmul kernel is not used (%s); oneDNN runs the matmuls", e)
    places = [
        (parent, name) for parent, name, m in _children(model) if isinstance(m, Linear)
    ]  # the head last
    linears = [getattr(parent, name) for parent, name in places]
    panels: list[torch.Tensor | None] = [None] * len(places)
    codes: list[BlockCodes | None] = [None] * len(places)
    qpanels: list[torch.Tensor | None] = [None] * len(places)
    if small is not None:  # all panels in one allocation on huge pages (engine/cpu/huge_pages.py)
        codes = _block_codes(model, linears, blocks) if blocks else [None] * len(linears)
        panels, qpanels = _arena(linears, codes)
    del (
        linears
    )  # NOTE: each dense weight is freed as soon as its module is swapped, as it was when packed in place
    for (parent, name), out, c, qout in zip(places, panels, codes, qpanels, strict=True):
        linear = getattr(parent, name)
        setattr(parent, name, _fast_linear(linear, small, out, c, qout))
    return small, small is not None


def swap_amx_linears(model: NativeModel, amx: AmxGemm, blocks: Mapping[str, BlockCodes]) -> bool:
    """bfloat16 with AMX (every K a multiple of 32): every ``Linear`` on the tiles for calls of every size,
    behind the checkpoint's blocks where they round to the weight; returns True (every row takes one kernel
    whatever its batch)."""
    places = [(parent, name) for parent, name, m in _children(model) if isinstance(m, Linear)]
    qgemm = _amx_quantized() if blocks else None
    linears = [getattr(parent, name) for parent, name in places]
    codes = _block_codes(model, linears, blocks) if qgemm is not None else [None] * len(linears)
    del linears
    for (parent, name), c in zip(places, codes, strict=True):
        m = getattr(parent, name)
        setattr(parent, name, _amx_linear(amx, qgemm, m.weight.detach(), m.bias, c))
    return True


def swap_bf16_panel_linears(model: NativeModel, dot: Bf16Gemm, blocks: Mapping[str, BlockCodes]) -> bool:
    """bfloat16 with AVX512-BF16 and no AMX: every ``Linear`` on the dot-product kernel's panels, for calls of
    every size, behind the checkpoint's blocks where they round to the weight; returns True (every row takes
    one kernel whatever its batch)."""
    places = [(parent, name) for parent, name, m in _children(model) if isinstance(m, Linear)]
    linears = [getattr(parent, name) for parent, name in places]
    codes = _block_codes(model, linears, blocks) if blocks else [None] * len(linears)
    del linears
    for (parent, name), c in zip(places, codes, strict=True):
        m = getattr(parent, name)
        panels = Bf16PanelLinear(dot, m.weight.detach(), m.bias)
        packed = None if c is None else dot.pack_blocks(c)
        setattr(
            parent, name, panels if packed is None else QuantBf16PanelLinear(packed[0], packed[1], panels)
        )
    return True


def _tiles_fit(model: NativeModel) -> bool:
    """Whether every ``Linear`` of ``model`` packs into AMX tiles (every K a multiple of 32)."""
    return all(amx_gemm.fits(m.in_features) for m in model.modules() if isinstance(m, Linear))


def swap_widened_linears(model: NativeModel) -> tuple[SmallGemm | None, bool]:
    """bfloat16 without AMX, batch-invariant: every ``Linear`` in float32 on the small kernel's panels of
    its bfloat16 weight, the outputs rounded to bfloat16 (``WidenedLinear``); returns the kernel and True, or
    (None, False) with nothing swapped where it cannot be built."""
    try:
        small = small_gemm.load()
    except KernelUnavailable as e:
        logger.warning("no batch-invariant bfloat16 matmuls here (%s)", e)
        return None, False
    places = [(parent, name) for parent, name, m in _children(model) if isinstance(m, Linear)]
    linears = [getattr(parent, name) for parent, name in places]
    panels, _ = _arena(linears, [None] * len(linears))
    del linears  # NOTE: each bfloat16 weight is freed as soon as its module is swapped
    for (parent, name), out in zip(places, panels, strict=True):
        m = getattr(parent, name)
        setattr(parent, name, WidenedLinear(small, m.weight.detach(), m.bias, out))
    return small, True


def _amx(model: NativeModel) -> AmxGemm | None:
    """The AMX kernel for a bfloat16 CPU model, where the CPU has AMX-BF16 and it could be built."""
    if not amx_gemm.supports(model.device, model.dtype):
        return None
    try:
        return amx_gemm.load()
    except KernelUnavailable as e:
        logger.info("the AMX matmul kernel is not used (%s); oneDNN runs bfloat16 matmuls", e)
        return None


def _bf16_dot(model: NativeModel) -> Bf16Gemm | None:
    """The AVX512-BF16 kernel for a bfloat16 CPU model, where the CPU has those dot products and it could be
    built."""
    if not bf16_gemm.supports(model.device, model.dtype):
        return None
    try:
        return bf16_gemm.load()
    except KernelUnavailable as e:
        logger.info("the AVX512-BF16 matmul kernel is not used (%s)", e)
        return None


def _amx_quantized() -> AmxQGemm | None:
    """The kernel that expands a checkpoint's blocks into AMX tiles, where it could be built."""
    try:
        return amx_qgemm.load()
    except KernelUnavailable as e:
        logger.info("bfloat16 decode steps read the bfloat16 weights (%s)", e)
        return None


def _amx_linear(
    amx: AmxGemm,
    qgemm: AmxQGemm | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    codes: BlockCodes | None,
) -> nn.Module:
    """A bfloat16 ``Linear``'s replacement: its AMX tiles, behind the checkpoint's blocks where the kernel
    gives their weights exactly (``amx_qgemm.pack``)."""
    tiles = AmxLinear(amx, weight, bias)
    if qgemm is None or codes is None:
        return tiles
    packed = amx_qgemm.pack(codes)
    return tiles if packed is None else QuantAmxLinear(qgemm, packed[0], packed[1], tiles)


def _fast_linear(
    linear: Linear,
    small: SmallGemm | None,
    out: torch.Tensor | None,
    codes: BlockCodes | None,
    qout: torch.Tensor | None,
) -> nn.Module:
    """``linear``'s replacement: oneDNN's copy (without ``small``), else the small kernel's panels (into
    ``out``) and the blocks' quantized panels (``codes``, into ``qout``)."""
    weight, bias = linear.weight.detach(), linear.bias
    if small is None:
        return PackedLinear(weight, bias)
    fast = SmallGemmLinear(small, weight, bias, out)
    return fast if codes is None else QuantPanelLinear(small.pack_blocks(codes, qout), fast)


def _arena(
    linears: list[Linear], codes: list[BlockCodes | None]
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Per Linear: its float32 panels and (where it has ``codes``) its quantized panels, all in one
    allocation on huge pages."""
    shapes = [SmallGemm.packed_shape(m.out_features, m.in_features) for m in linears]
    qshapes = [
        SmallGemm.qpacked_shape(m.out_features, m.in_features, c.offsets is not None)
        for m, c in zip(linears, codes, strict=True)
        if c is not None
    ]
    dtypes = [torch.float32] * len(shapes) + [torch.uint8] * len(qshapes)
    arena = iter(huge_pages.empty_many([*shapes, *qshapes], dtypes))
    panels: list[torch.Tensor | None] = [next(arena) for _ in shapes]
    qpanels: list[torch.Tensor | None] = [None if c is None else next(arena) for c in codes]
    return panels, qpanels


def _block_codes(
    model: NativeModel, linears: list[Linear], blocks: Mapping[str, BlockCodes]
) -> list[BlockCodes | None]:
    """Per Linear: its weight as ``blocks`` hold it (the fused ones' parts in row order), or None where a
    part is missing, parts mix kinds, or the blocks do not give the loaded weight bit for bit (rounded to
    its dtype)."""
    parts: dict[int, list[tuple[int, int, BlockCodes]]] = {}
    for name, (param, start, end) in model.weight_slots().items():
        if name in blocks:
            parts.setdefault(param.data_ptr(), []).append((start, end, blocks[name]))
    result: list[BlockCodes | None] = []
    for module in linears:
        pieces = sorted(parts.get(module.weight.data_ptr(), []), key=lambda piece: piece[0])
        starts = [0] + [end for _, end, _ in pieces]
        whole = (
            bool(pieces) and [s for s, _, _ in pieces] == starts[:-1] and starts[-1] == module.out_features
        )
        joined = BlockCodes.cat([c for _, _, c in pieces]) if whole else None
        weight = module.weight.detach()
        if joined is not None and torch.equal(joined.dequantize().to(weight.dtype), weight):
            result.append(joined)
        else:
            result.append(None)
    return result


def swap_fused_ops(model: NativeModel) -> CpuOps | None:
    """RMSNorm (with its residual add), the rotary embedding and SwiGLU's (GeGLU's) activation in the fused CPU ops:
    only on the CPU, in float32 or bfloat16, where the ops could be built (else the reason is logged)."""
    if not CpuOps.supports(model.device, model.dtype):
        return None
    try:
        ops = cpu_ops.load()
    except KernelUnavailable as e:
        logger.warning("the fused CPU ops are not used (%s); PyTorch runs them", e)
        return None
    for parent, name, module in _children(model):
        fused = _fused(module, ops)
        if fused is not None:
            setattr(parent, name, fused)
    return ops


def swap_swiglu_mlps(model: NativeModel) -> int:
    """Every SiLU-gated MLP whose gate and up weight is on AMX tiles or AVX512-BF16 panels (alone or behind the
    checkpoint's blocks) without a bias, and whose gate is the fused op, takes the kernel's SwiGLU call for
    calls of more rows than read the blocks (``FusedSwiGLUMLP``: the same bits); returns how many."""
    swapped = 0
    for parent, name, module in _children(model):
        if type(module) is not GatedMLP or type(module.act_fn) is not FusedSiLUMul:
            continue
        proj = module.gate_up_proj
        packed = proj.rest if isinstance(proj, QuantAmxLinear | QuantBf16PanelLinear) else proj
        if not isinstance(packed, AmxLinear | Bf16PanelLinear) or packed.bias is not None:
            continue
        amx = isinstance(packed, AmxLinear)
        if module.intermediate_size % (amx_gemm.TILE_N if amx else bf16_gemm.PANEL) == 0:
            fewest = amx_qgemm.MAX_ROWS if amx else bf16_gemm.QUANTIZED_MAX_ROWS
            setattr(parent, name, FusedSwiGLUMLP(module, packed, fewest))
            swapped += 1
    return swapped


def _fused(module: nn.Module, ops: CpuOps) -> nn.Module | None:
    """``module``'s fused replacement, if it has one. NOTE: exact types: a module swapped already stays."""
    if type(module) is RMSNorm:
        return FusedRMSNorm(module, ops)
    if type(module) is RotaryEmbedding:
        return FusedRotaryEmbedding(module, ops)
    if type(module) is SiluAndMul:
        return FusedSiLUMul(ops)
    if type(module) is GeluTanhAndMul:
        return FusedGeluTanhMul(ops)
    return None


def _children(root: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, module) for every module under ``root``, in ``root.modules()`` order."""
    found: list[tuple[nn.Module, str, nn.Module]] = []
    for path, module in root.named_modules():
        if path:
            parent, _, name = path.rpartition(".")
            found.append((root.get_submodule(parent), name, module))
    return found
