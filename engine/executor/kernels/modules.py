"""The CPU kernels as modules that take the place of the model's own after loading, as gpt-fast's
``WeightOnlyInt4Linear`` takes ``nn.Linear``'s: each has the contract of the module it replaces and one
``forward``. engine/executor/fast_paths.py decides which go where; the model never learns they exist.

    PackedLinear          oneDNN over a weight reordered once into its blocked layout (prepacked.py)
    SmallGemmLinear       float32 on the small kernel's panels (small_gemm.py), for calls of every size
    WidenedLinear         bfloat16 rows in float32 on those panels, rounded once (batch invariance, AVX2 CPUs)
    Bf16PanelLinear       bfloat16 on AVX512-BF16 dot products (bf16_gemm.py), for calls of every size
    QuantBf16PanelLinear  a quantized checkpoint's blocks expanded into those panels' pairs, up to 12 rows
    QuantPanelLinear      a quantized checkpoint's blocks, expanded in registers, for calls of a few rows
    AmxLinear             bfloat16 on AMX tiles (amx_gemm.py), oneDNN for larger calls unless it takes them all
    QuantAmxLinear        a quantized checkpoint's blocks expanded into AMX tiles, for calls of up to 32 rows
    FusedRMSNorm          RMSNorm with its residual add in one C call (cpu_ops.py)
    FusedRotaryEmbedding  q and k rotated in place in one C call
    FusedSiLUMul          SwiGLU's ``silu(gate) * up`` in one C call
    FusedSwiGLUMLP        SwiGLU's gate and up projections and its gate in one call (AMX, AVX512-BF16), more rows
    FusedGeluTanhMul      Gemma's ``gelu_tanh(gate) * up`` in one C call
"""

from __future__ import annotations

from typing import Generic, TypeVar

import torch
from torch import nn

from engine.executor.kernels import amx_qgemm, bf16_gemm, prepacked, small_gemm
from engine.executor.kernels.amx_gemm import AmxGemm
from engine.executor.kernels.amx_qgemm import AmxQGemm
from engine.executor.kernels.bf16_gemm import Bf16Gemm
from engine.executor.kernels.cpu_ops import CpuOps
from engine.executor.kernels.small_gemm import SmallGemm
from engine.executor.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, RotaryInputs


class PackedLinear(nn.Module):
    """``x W^T + b`` with ``W`` in oneDNN's prepacked layout (an opaque tensor only ``prepacked.linear`` reads)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = prepacked.prepack(weight)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return prepacked.linear(x, self.packed, self.bias)  # [..., out_features]


class SmallGemmLinear(nn.Module):
    """``x W^T + b`` with ``W`` in the small kernel's 16-output panels (``SmallGemm.pack``; into ``out`` if
    given), for calls of every size: a row's bits never depend on its batch."""

    def __init__(
        self,
        small: SmallGemm,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.small = small
        self.panels = small.pack(weight.detach(), out)  # [ceil(out / 16), in, 16]
        self.bias = bias

    def takes(self, num_rows: int) -> bool:
        """Whether a call of ``num_rows`` rows runs on the panels: every call does."""
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small.matmul(x, self.panels, self.out_features, self.bias)  # [..., out_features]


class WidenedLinear(nn.Module):
    """bfloat16 ``x W^T + b`` computed in float32 on the small kernel's panels of the bfloat16 weight (widened
    exactly: a bfloat16 value is a float32 one), each output rounded to bfloat16 once. On CPUs without
    AMX-BF16 it gives a bfloat16 model matmuls whose rows' bits do not depend on their batch (the kernel
    takes every call, one float32 chain per output over ``k`` in order): ``batch_invariant``'s, where
    oneDNN's bfloat16 kernels (or none, on an AVX2-only CPU) would round by the call's row count."""

    def __init__(
        self,
        small: SmallGemm,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        wide_bias = None if bias is None else bias.detach().float().contiguous()
        self.wide = SmallGemmLinear(small, weight.detach().float(), wide_bias, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(x.float()).to(x.dtype)  # [..., out_features]


class Bf16PanelLinear(nn.Module):
    """``x W^T + b`` in bfloat16 with ``W`` in the AVX512-BF16 kernel's panels of k-pairs (``Bf16Gemm.pack``),
    for calls of every size (CPUs without AMX: AMD Zen 4 and later), so a row's bits never depend on its
    batch."""

    def __init__(self, gemm: Bf16Gemm, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.gemm = gemm
        self.panels = gemm.pack(weight)  # [ceil(out / 16), ceil(in / 2), 16, 2]
        self.bias = bias

    def takes(self, num_rows: int) -> bool:
        """Whether a call of ``num_rows`` rows runs on the panels: every call does."""
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm.linear(x, self.panels, self.out_features, self.bias)  # [..., out_features]

    def swiglu(self, x: torch.Tensor, inter: int) -> torch.Tensor:
        """For a gated MLP's fused gate and up weight: ``silu(g) * u`` of ``forward(x) = [g | u]`` in one call."""
        return self.gemm.swiglu(x, self.panels, inter)  # [..., inter]

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x).float()``, written as float32 by the kernel: an output head's logits without a
        second pass over them (``DecoderOnlyLM.compute_logits``)."""
        return self.gemm.linear(x, self.panels, self.out_features, self.bias, torch.float32)


class AmxLinear(nn.Module):
    """``x W^T + b`` in bfloat16 with ``W`` in the AMX kernel's tiles (``AmxGemm.pack``), for calls of every
    size (as fast as oneDNN's from ~1,300 rows, faster below: docs/BENCHMARKS.md), so a row's bits never
    depend on its batch."""

    def __init__(self, amx: AmxGemm, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.amx = amx
        self.tiles = amx.pack(weight)  # [ceil(out / 64) * 4, in / 32, 16, 16, 2]
        self.bias = bias

    def takes(self, num_rows: int) -> bool:
        """Whether a call of ``num_rows`` rows runs on the tiles: every call does."""
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.amx.linear(x, self.tiles, self.out_features, self.bias)  # [..., out_features]

    def swiglu(self, x: torch.Tensor, inter: int) -> torch.Tensor:
        """For a gated MLP's fused gate and up weight: ``silu(g) * u`` of ``forward(x) = [g | u]`` in one call."""
        return self.amx.swiglu(x, self.tiles, inter)  # [..., inter]


Rest = TypeVar("Rest", SmallGemmLinear, AmxLinear, Bf16PanelLinear)


class _BlocksInFront(nn.Module, Generic[Rest]):
    """A module that reads a checkpoint's blocks of codes for some calls and hands the others to ``rest``,
    the same weight unquantized: the bias and which calls run on cbserve's kernels are ``rest``'s."""

    def __init__(self, rest: Rest) -> None:
        super().__init__()
        self.out_features, self.in_features = rest.out_features, rest.in_features
        self.rest: Rest = rest

    @property
    def bias(self) -> torch.Tensor | None:
        return self.rest.bias

    def takes(self, num_rows: int) -> bool:
        """Whether a call of ``num_rows`` rows runs on cbserve's kernels (blocks, panels or tiles)."""
        return self.rest.takes(num_rows)


class QuantPanelLinear(_BlocksInFront[SmallGemmLinear]):
    """``x W^T + b`` for a ``W`` that the checkpoint stored in blocks of codes (``BlockCodes``; their
    ``dequantize()`` is the loaded ``W`` bit for bit): calls of at most ``small_gemm.QUANTIZED_MAX_ROWS``
    rows read the blocks (``qpanels``, from ``SmallGemm.pack_blocks``), the same bits from a third to a
    quarter of the bytes; other calls go to ``rest``, the float32 panels of the same ``W``."""

    def __init__(self, qpanels: torch.Tensor, rest: SmallGemmLinear) -> None:
        super().__init__(rest)
        self.qpanels = qpanels  # uint8 [ceil(out / 16), in / 32, block bytes]
        self.small = rest.small

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if small_gemm.fits_quantized(x):
            return self.small.linear(x, self.qpanels, self.out_features, self.bias)  # [rows, out_features]
        return self.rest(x)


class QuantAmxLinear(_BlocksInFront[AmxLinear]):
    """``x W^T + b`` in bfloat16 for a ``W`` that the checkpoint stored in blocks of codes, each rounding to
    the loaded bfloat16 weight (engine/executor/fast_paths.py checks): calls of at most
    ``amx_qgemm.MAX_ROWS`` rows read the blocks (``qtiles``, from ``amx_qgemm.pack``), expanded into the tiles
    as they are multiplied -- the bits of ``rest``'s tiles from a third of the bytes; other calls go to
    ``rest``."""

    def __init__(self, qgemm: AmxQGemm, qtiles: torch.Tensor, four_bit: bool, rest: AmxLinear) -> None:
        super().__init__(rest)
        self.qgemm = qgemm
        self.qtiles = qtiles  # uint8 [ceil(out / 64) * 4, in / 32, tile bytes]
        self.four_bit = four_bit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= amx_qgemm.MAX_ROWS * self.in_features:
            return self.qgemm.linear(x, self.qtiles, self.four_bit, self.out_features, self.bias)
        return self.rest(x)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x).float()``, written as float32 by the kernel where it takes the rows: an output head's
        logits without a second pass over them (``DecoderOnlyLM.compute_logits``)."""
        if x.numel() <= amx_qgemm.MAX_ROWS * self.in_features:
            return self.qgemm.linear(
                x, self.qtiles, self.four_bit, self.out_features, self.bias, torch.float32
            )
        return self.rest(x).float()


class QuantBf16PanelLinear(_BlocksInFront[Bf16PanelLinear]):
    """``x W^T + b`` in bfloat16 for a ``W`` that the checkpoint stored in blocks of codes, each rounding to
    the loaded bfloat16 weight (engine/executor/fast_paths.py checks), on AVX512-BF16 without AMX: calls of
    at most ``bf16_gemm.QUANTIZED_MAX_ROWS`` rows read the blocks (``qpanels``, from
    ``Bf16Gemm.pack_blocks``), expanded into the panels' k-pairs as they are used -- the bits of ``rest``'s
    panels from 0.75 or 1.125 bytes a weight instead of 2; other calls go to ``rest``."""

    def __init__(self, qpanels: torch.Tensor, four_bit: bool, rest: Bf16PanelLinear) -> None:
        super().__init__(rest)
        self.qpanels = qpanels  # uint8 [ceil(out / 16), in / 32, block bytes]
        self.four_bit = four_bit
        self.gemm = rest.gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= bf16_gemm.QUANTIZED_MAX_ROWS * self.in_features:
            return self.gemm.qlinear(x, self.qpanels, self.four_bit, self.out_features, self.bias)
        return self.rest(x)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """``forward(x).float()``, written as float32 by the kernel (``DecoderOnlyLM.compute_logits``)."""
        if x.numel() <= bf16_gemm.QUANTIZED_MAX_ROWS * self.in_features:
            return self.gemm.qlinear(
                x, self.qpanels, self.four_bit, self.out_features, self.bias, torch.float32
            )
        return self.rest.forward_float(x)


class FusedRMSNorm(RMSNorm):
    """``RMSNorm`` of rows in one C call, and ``add_and_norm`` with the residual updated in place. Per-head
    norms (Qwen3's and Gemma 3's q/k: 3-D) norm each head as a row (the decode stack's C layer does the
    same, so both give the same bits)."""

    def __init__(self, norm: RMSNorm, ops: CpuOps) -> None:
        super().__init__(0, norm.eps, norm.weight.dtype, norm.weight.device)
        self.weight = norm.weight  # NOTE: the loaded weight, shared; the empty one made above is dropped
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.stride(1) == 1:
            return self.ops.rms_norm(x, self.weight, self.eps)  # [rows, hidden]
        if x.dim() == 3 and x.shape[-1] == self.weight.shape[0]:  # [tokens, heads, head_dim]
            heads = x.reshape(-1, x.shape[-1])  # [tokens * heads, head_dim]; a copy of a strided view
            return self.ops.rms_norm(heads, self.weight, self.eps).view(x.shape)
        return super().forward(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual), residual  # residual += x, in place


class FusedRotaryEmbedding(nn.Module):
    """``RotaryEmbedding``'s rotation in one C call, in place, reading ``rotary``'s cos/sin tables by
    position (``prepare`` checks the positions once per forward, so the op need not)."""

    def __init__(self, rotary: RotaryEmbedding, ops: CpuOps) -> None:
        super().__init__()
        self.head_dim = rotary.head_dim
        self.cos: torch.Tensor
        self.sin_signed: torch.Tensor
        self.register_buffer("cos", rotary.cos, persistent=False)  # [max_pos, head_dim]
        self.register_buffer("sin_signed", rotary.sin_signed, persistent=False)  # [max_pos, head_dim]
        self.ops = ops

    def prepare(self, positions: torch.Tensor) -> RotaryInputs:
        if positions.numel():
            lo, hi = (int(p) for p in torch.aminmax(positions))
            if lo < 0 or hi >= self.cos.shape[0]:
                raise IndexError(f"positions {lo}..{hi} outside the rotary table of {self.cos.shape[0]}")
        return RotaryInputs(positions)

    def rotate_with(self, x: torch.Tensor, inputs: RotaryInputs) -> torch.Tensor:
        self.ops.rotary(x, inputs.positions, self.cos, self.sin_signed)  # x: [num_tokens, heads, head_dim]
        return x


class FusedSiLUMul(nn.Module):
    """``SiluAndMul`` in one C call: ``gate_up`` ``[rows, 2 * inter]`` -> ``[rows, inter]``."""

    def __init__(self, ops: CpuOps) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(gate_up)  # [rows, inter]


class FusedGeluTanhMul(nn.Module):
    """``GeluTanhAndMul`` (Gemma) in one C call: ``gate_up`` ``[rows, 2 * inter]`` -> ``[rows, inter]``."""

    def __init__(self, ops: CpuOps) -> None:
        super().__init__()
        self.ops = ops

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_tanh_and_mul(gate_up)  # [rows, inter]


class FusedSwiGLUMLP(GatedMLP):
    """``GatedMLP`` (SiLU) whose gate and up weight is on AMX tiles or AVX512-BF16 panels: calls of more rows
    than read the checkpoint's blocks (``fewest``: prefill chunks; decode steps run in the decode stack) take
    the projection and the gate in one call (the module's ``swiglu``: the bits of ``gate_up_proj`` then
    ``act_fn``, without writing the ``[rows, 2 * inter]`` projection out and reading it back); others run the
    modules as ``GatedMLP`` does. The submodules are the swapped ones, unchanged."""

    def __init__(self, mlp: GatedMLP, packed: AmxLinear | Bf16PanelLinear, fewest: int) -> None:
        nn.Module.__init__(self)
        self.intermediate_size = mlp.intermediate_size
        self.gate_up_proj, self.act_fn, self.down_proj = mlp.gate_up_proj, mlp.act_fn, mlp.down_proj
        self._packed = [packed]  # NOTE: in a list, not a second registration of gate_up_proj's module
        self.fewest = fewest

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.fewest * x.shape[-1]:
            return super().forward(x)
        return self.down_proj(self._packed[0].swiglu(x, self.intermediate_size))  # [..., hidden]
