"""Building blocks shared by the decoder-only models: RMSNorm, rotary embedding (default and llama3 scaling),
the fused gated MLP, and a bias-optional linear layer whose weights are filled by ``load_weights``.

Parameters are created with ``torch.empty`` directly in the model's dtype and device (no random init, no fp32
copy): every value comes from the checkpoint.

RMSNorm, the rotary embedding and the MLP's activation run in PyTorch, or in the fused CPU ops of
engine/executor/kernels/cpu_ops.py once ``cpu_ops`` is set on them (``LlamaForCausalLM.use_cpu_ops``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.executor.kernels import prepacked, small_gemm
from engine.executor.kernels.block_codes import BlockCodes
from engine.executor.kernels.cpu_ops import CpuOps
from engine.executor.kernels.small_gemm import SmallGemm


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` ``[out_features, in_features]``, uninitialised until loaded.

    After ``prepack()`` (CPU), ``weight`` is an empty placeholder and ``W`` lives in oneDNN's blocked layout
    (engine/executor/kernels/prepacked.py), or with ``small`` (float32) in the small kernel's 16-output panels
    (engine/executor/kernels/small_gemm.py): there alone where that kernel takes every batch, else as a second copy
    that serves calls of at most ``small_gemm.MAX_ROWS`` rows (decode steps). A weight loaded from a
    quantized checkpoint also keeps its blocks (``small_qpacked``) for calls of at most
    ``small_gemm.QUANTIZED_MAX_ROWS`` rows, where reading a third to a quarter of the bytes pays more than
    expanding them costs: the same bits."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.packed: torch.Tensor | None = None
        self.small: SmallGemm | None = None
        self.small_packed: torch.Tensor | None = None
        self.small_qpacked: torch.Tensor | None = None  # the blocks, when the checkpoint stored W in them

    @property
    def is_prepacked(self) -> bool:
        return self.packed is not None or self.small_packed is not None

    def prepack(
        self,
        small: SmallGemm | None = None,
        onednn: bool = True,
        out: torch.Tensor | None = None,
        codes: BlockCodes | None = None,
        qout: torch.Tensor | None = None,
    ) -> None:
        """Move ``W`` into the small kernel's panels (with ``small``; into ``out`` if given, of
        ``SmallGemm.packed_shape``) and/or oneDNN's prepacked layout (with ``onednn``), freeing the dense
        copy. With ``small`` and ``codes`` (``W`` as a checkpoint stored it in blocks: ``codes.dequantize()``
        equal to ``W``), the blocks too, into ``qout`` if given (``SmallGemm.qpacked_shape``)."""
        if not self.is_prepacked:
            if small is not None:
                self.small, self.small_packed = small, small.pack(self.weight.detach(), out)
                if codes is not None:
                    self.small_qpacked = small.pack_blocks(codes, qout)
            if onednn or small is None:
                self.packed = prepacked.prepack(self.weight)
            self.weight = empty_param(0, dtype=self.weight.dtype, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small is not None and self.small_qpacked is not None and small_gemm.fits_quantized(x):
            return self.small.linear(x, self.small_qpacked, self.out_features, self.bias)
        if self.small is not None and self.small_packed is not None:
            if self.packed is None:
                return self.small.matmul(x, self.small_packed, self.out_features, self.bias)
            if small_gemm.fits(x):
                return self.small.linear(x, self.small_packed, self.out_features, self.bias)
        if self.packed is not None:
            return prepacked.linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis, computed in fp32 as transformers does."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim, dtype=dtype, device=device)
        self.cpu_ops: CpuOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None and x.dim() == 2 and x.stride(1) == 1:  # NOTE: per-head norms are 3-D
            return self.cpu_ops.rms_norm(x, self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` and its norm: ``(norm, new residual)``. The fused CPU op updates ``residual`` in
        place and returns it; the PyTorch path returns a new tensor."""
        if self.cpu_ops is not None:
            return self.cpu_ops.rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual + x
        return self.forward(residual), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32), with Llama 3.1's frequency-dependent scaling when
    ``scaling`` says ``rope_type: llama3``. Raises ``ValueError`` for other scaling types."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if scaling is None or rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: 'default', 'llama3'")
    try:
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"llama3 rope scaling is missing the field {e.args[0]!r}: {scaling}") from None
    # Long wavelengths are divided by ``factor``, short ones kept, the band between interpolated smoothly.
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclass(frozen=True)
class RotaryInputs:
    """One batch's rotation: its positions, and for the PyTorch path their cos/signed-sin rows."""

    positions: torch.Tensor  # [num_tokens] int64
    cos: torch.Tensor | None  # [num_tokens, 1, head_dim]
    sin_signed: torch.Tensor | None


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout of Llama checkpoints in HF format.

    A cos/sin table ``[max_positions, head_dim]`` is precomputed; ``cos_sin(positions)`` indexes it once
    per forward and ``rotate`` rotates any ``[num_tokens, heads, head_dim]`` tensor with it.
    The sign of ``rotate_half`` is folded into the sin table so a rotation is roll + 2 multiply-adds.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)  # [head_dim // 2]
        freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq  # [max_pos, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        sign = torch.cat((-torch.ones_like(inv_freq), torch.ones_like(inv_freq)))  # [head_dim]
        # Non-persistent: not part of the checkpoint; rebuilt from the config.
        self.cos: torch.Tensor
        self.sin_signed: torch.Tensor
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)  # [max_pos, head_dim]
        self.register_buffer("sin_signed", (emb.sin() * sign).to(dtype), persistent=False)  # [max_pos, head_dim]
        self.cpu_ops: CpuOps | None = None

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[num_tokens]`` -> (cos, signed sin), each ``[num_tokens, 1, head_dim]``."""
        return self.cos[positions][:, None], self.sin_signed[positions][:, None]

    def prepare(self, positions: torch.Tensor) -> RotaryInputs:
        """What ``rotate_with`` needs for this batch's ``positions`` ``[num_tokens]``, computed once per forward."""
        if self.cpu_ops is not None:
            if positions.numel():
                lo, hi = (int(p) for p in torch.aminmax(positions))
                if lo < 0 or hi >= self.cos.shape[0]:
                    raise IndexError(f"positions {lo}..{hi} outside the rotary table of {self.cos.shape[0]}")
            return RotaryInputs(positions, None, None)
        cos, sin_signed = self.cos_sin(positions)
        return RotaryInputs(positions, cos, sin_signed)

    def rotate_with(self, x: torch.Tensor, inputs: RotaryInputs) -> torch.Tensor:
        """``x`` ``[num_tokens, heads, head_dim]`` rotated: in place by the fused CPU op, else a new tensor."""
        if inputs.cos is None or inputs.sin_signed is None:
            assert self.cpu_ops is not None
            self.cpu_ops.rotary(x, inputs.positions, self.cos, self.sin_signed)
            return x
        return self.rotate(x, inputs.cos, inputs.sin_signed)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) * sin == roll(x, d/2) * sin_signed``."""
        rotated = torch.roll(x, shifts=self.head_dim // 2, dims=-1)  # [num_tokens, heads, head_dim]
        return torch.addcmul(x * cos, rotated, sin_signed)  # [num_tokens, heads, head_dim]


class GatedMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``[2 * inter, hidden]`` matmul
    (rows ``[0, inter)`` gate, ``[inter, 2 * inter)`` up)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, dtype=dtype, device=device)
        self.cpu_ops: CpuOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None:
            return self.down_proj(self.cpu_ops.silu_and_mul(self.gate_up_proj(x)))  # [num_tokens, hidden]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # 2 x [num_tokens, inter]
        return self.down_proj(F.silu(gate) * up)  # [num_tokens, hidden]
