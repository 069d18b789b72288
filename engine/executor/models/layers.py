"""Building blocks shared by the decoder-only models: a bias-optional linear layer, RMSNorm, rotary embedding
(default, llama3 and linear scaling), and the gated MLP with gate and up fused into one matmul.

Parameters are created with ``torch.empty`` directly in the model's dtype and device (no random init, no fp32
copy): every value comes from the checkpoint (``load_weights``).

Everything here is plain PyTorch. On the CPU the loader swaps faster modules in after loading (oneDNN-packed
and small-batch matmuls, fused norm, rotary and SiLU; engine/executor/fast_paths.py); they keep these
modules' contracts (``forward``, ``RMSNorm.add_and_norm``, ``RotaryEmbedding.prepare`` / ``rotate_with``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` ``[out_features, in_features]``, uninitialised until loaded; or, with
    ``weight``, that parameter shared (a tied output head reads the embedding)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = (
            empty_param(out_features, in_features, dtype=dtype, device=device) if weight is None else weight
        )
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [..., out_features]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis, normalised in float32 as transformers does.

    The weight's dtype says where the result is rounded to ``x``'s dtype, in the order of the model's
    transformers code: a weight in the model's dtype scales the rounded norm (Llama: ``weight *
    normed.to(dtype)``, two roundings in bfloat16); a float32 weight (``scale_in_float32``: Gemma, whose
    ``(1 + weight)`` transformers computes in float32) scales the float32 norm, rounded once. In a float32
    model both are the same product."""

    def __init__(
        self, dim: int, eps: float, dtype: torch.dtype, device: torch.device, scale_in_float32: bool = False
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = empty_param(dim, dtype=torch.float32 if scale_in_float32 else dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.weight.dtype == torch.float32:
            return (normed * self.weight).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` and its norm: ``(norm, new residual)``. This returns a new residual; a fused
        swap may update ``residual`` in place and return it (callers use the returned one only)."""
        residual = residual + x
        return self.forward(residual), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32), with Llama 3.1's frequency-dependent scaling when
    ``scaling`` says ``rope_type: llama3``, every one divided by ``factor`` for ``linear`` (positions
    interpolated: Gemma 3's global layers). Raises ``ValueError`` for other scaling types."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if scaling is None or rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type != "llama3":
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: 'default', 'llama3', 'linear'"
        )
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
    """One batch's rotation: its positions, and for the PyTorch rotation their cos/signed-sin rows (a fused
    swap reads the table by position and leaves them None)."""

    positions: torch.Tensor  # [num_tokens] int64
    cos: torch.Tensor | None = None  # [num_tokens, 1, head_dim]
    sin_signed: torch.Tensor | None = None


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
        freqs = (
            torch.arange(max_positions, device=device).float()[:, None] * inv_freq
        )  # [max_pos, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        sign = torch.cat((-torch.ones_like(inv_freq), torch.ones_like(inv_freq)))  # [head_dim]
        # Non-persistent: not part of the checkpoint; rebuilt from the config.
        self.cos: torch.Tensor
        self.sin_signed: torch.Tensor
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)  # [max_pos, head_dim]
        self.register_buffer(
            "sin_signed", (emb.sin() * sign).to(dtype), persistent=False
        )  # [max_pos, head_dim]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[num_tokens]`` -> (cos, signed sin), each ``[num_tokens, 1, head_dim]``."""
        return self.cos[positions][:, None], self.sin_signed[positions][:, None]

    def prepare(self, positions: torch.Tensor) -> RotaryInputs:
        """What ``rotate_with`` needs for this batch's ``positions`` ``[num_tokens]``, computed once per forward."""
        cos, sin_signed = self.cos_sin(positions)
        return RotaryInputs(positions, cos, sin_signed)

    def rotate_with(self, x: torch.Tensor, inputs: RotaryInputs) -> torch.Tensor:
        """``x`` ``[num_tokens, heads, head_dim]`` rotated (a new tensor), with ``inputs`` from ``prepare``."""
        if inputs.cos is None or inputs.sin_signed is None:
            raise ValueError("rotate_with needs the cos/sin rows that this module's prepare() gives")
        return self.rotate(x, inputs.cos, inputs.sin_signed)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) * sin == roll(x, d/2) * sin_signed``."""
        rotated = torch.roll(x, shifts=self.head_dim // 2, dims=-1)  # [num_tokens, heads, head_dim]
        return torch.addcmul(x * cos, rotated, sin_signed)  # [num_tokens, heads, head_dim]


class SiluAndMul(nn.Module):
    """SwiGLU's gate: ``silu(gate) * up`` for ``gate_up`` ``[num_tokens, 2 * inter]`` (gate first)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # 2 x [num_tokens, inter]
        return F.silu(gate) * up  # [num_tokens, inter]


class GeluTanhAndMul(nn.Module):
    """GeGLU's gate (Gemma's MLP): ``gelu_tanh(gate) * up`` for ``gate_up`` ``[num_tokens, 2 * inter]``."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # 2 x [num_tokens, inter]
        return F.gelu(gate, approximate="tanh") * up  # [num_tokens, inter]


class GatedMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``[2 * inter, hidden]`` matmul
    (rows ``[0, inter)`` gate, ``[inter, 2 * inter)`` up); ``act_fn`` another gate (Gemma's GELU-tanh)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device: torch.device,
        act_fn: nn.Module | None = None,
    ):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype, device=device)
        self.act_fn = act_fn if act_fn is not None else SiluAndMul()
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * inter]
        return self.down_proj(self.act_fn(gate_up))  # [num_tokens, hidden]
