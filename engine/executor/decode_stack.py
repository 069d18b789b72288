"""The decoder layers of a CPU decode step in one C call (``kernels/csrc/decode_stack.c``): an executor
fast path, next to the CUDA-graph decoder (engine/executor/cuda_graphs.py); the runner picks it per step.

A decode step of a small model on a few cores is ~300 short C calls when run layer by layer from Python:
the matmuls (engine/executor/kernels/small_gemm.py), decode attention (engine/executor/attention/cpu_kernel.py)
and the fused element-wise ops (engine/executor/kernels/cpu_ops.py). Between them one thread runs Python
while the other waits in OpenMP's barrier. The stack runs the same kernels, in the same order, for every
layer in one parallel region: the result is that of the layer-by-layer path (tests/model/test_decode_stack.py).

It reads its weights from the model's flat table (``decoder_table`` of the Llama or Gemma model) once the
CPU fast paths are in (engine/executor/fast_paths.py): float32 with every projection in the small kernel's
panels, or bfloat16 with every projection in the AMX kernel's tiles (CPUs with AMX-BF16) or the AVX512-BF16
kernel's panels (CPUs with those dot products but no AMX), and the fused ops
(per-head q/k norms and each layer's rotary table included: Qwen3, Gemma 3). It runs steps where every
sequence computes one token with the CPU decode kernel (``CpuDecodeStack.can_run``); everything else runs
layer by layer.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from engine.cpu.native_build import BuildOnce, KernelUnavailable
from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.inputs import BatchInputs
from engine.executor.kernels.modules import (
    AmxLinear,
    Bf16PanelLinear,
    FusedGeluTanhMul,
    FusedRMSNorm,
    FusedRotaryEmbedding,
    FusedSiLUMul,
    QuantAmxLinear,
    QuantBf16PanelLinear,
    QuantPanelLinear,
    SmallGemmLinear,
)
from engine.executor.kernels.small_gemm import has_offsets
from engine.executor.kv_cache import KVCache
from engine.executor.models.gemma import GemmaForCausalLM
from engine.executor.models.llama import LayerModules, LlamaForCausalLM
from engine.executor.models.registry import NativeModel

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "csrc" / "decode_stack.c"

_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [
        *(
            (name, _ptr)
            for name in (
                "input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "down", "k_cache",
                "v_cache",
            )
        ),
        *((name, _ptr) for name in ("qkv_q", "o_q", "gate_up_q", "down_q")),
        *((name, _i64) for name in ("qkv_q_offsets", "o_q_offsets", "gate_up_q_offsets", "down_q_offsets")),
        ("rotate", _i64),
        ("sliding_window", _i64),
        ("post_attn_norm", _ptr),
        ("post_ff_norm", _ptr),
        ("gelu", _i64),
        *((name, _ptr) for name in ("q_norm", "k_norm", "cos", "sin_signed")),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim")),
        *((name, _i64) for name in ("intermediate", "num_blocks", "block_size")),
        ("max_positions", _i64),
        ("eps", _f32),
        ("scale", _f32),
        ("softcap", _f32),
        ("final_norm", _ptr),
        ("bf16", _i64),
        ("f32_norms", _i64),
        ("bf16_dot", _i64),
    ]


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _packed(m: Panels) -> torch.Tensor:
    """A projection's weights as the stack's matmuls read them: float32 panels, bfloat16 AMX tiles or
    bfloat16 panels of k-pairs."""
    if isinstance(m, AmxLinear):
        return m.tiles
    if isinstance(m, QuantAmxLinear):
        return m.rest.tiles
    return m.rest.panels if isinstance(m, QuantPanelLinear | QuantBf16PanelLinear) else m.panels


def _quantized(m: Panels) -> tuple[torch.Tensor | None, int]:
    """A projection's blocks as the stack's matmuls read them (float32 panels', bfloat16 tiles' or bfloat16
    panels'), or None; and 1 where they hold offsets (the bfloat16 kernels' 4-bit codes), 0 where not."""
    if isinstance(m, QuantPanelLinear):
        return m.qpanels, int(has_offsets(m.qpanels))
    if isinstance(m, QuantAmxLinear):
        return m.qtiles, int(m.four_bit)
    if isinstance(m, QuantBf16PanelLinear):
        return m.qpanels, int(m.four_bit)
    return None, 0


def _weight(norm: nn.Module | None) -> torch.Tensor | None:
    """A (fused) norm's weight; None for no norm."""
    return None if norm is None else cast(torch.Tensor, norm.weight)


Panels = (
    SmallGemmLinear | QuantPanelLinear | AmxLinear | QuantAmxLinear | Bf16PanelLinear | QuantBf16PanelLinear
)
# the projections the stack's matmuls read, per dtype: float32 panels; bfloat16 AMX tiles, or panels of
# k-pairs (AVX512-BF16, CPUs without AMX), all the model's of one kind
_MATMULS: dict[torch.dtype, tuple[tuple[type, ...], ...]] = {
    torch.float32: ((SmallGemmLinear, QuantPanelLinear),),
    torch.bfloat16: ((AmxLinear, QuantAmxLinear), (Bf16PanelLinear, QuantBf16PanelLinear)),
}


@dataclass(frozen=True)
class StackLayer:
    """One layer's weights as the stack reads them: the norms' weights, and per projection its float32
    panels (or bfloat16 AMX tiles), its bias and (where the checkpoint stored it in blocks) its quantized
    panels."""

    input_norm: torch.Tensor
    qkv: Panels
    o: Panels
    post_norm: torch.Tensor
    gate_up: Panels
    down: Panels
    rotate: bool  # False: a layer without rotary embeddings (SmolLM3's NoPE layers)
    sliding_window: int | None
    post_attn_norm: torch.Tensor | None  # Gemma's norms of the attention's and the MLP's outputs
    post_ff_norm: torch.Tensor | None
    gelu: bool  # the MLP's gate: GELU-tanh (Gemma) or SiLU
    q_norm: torch.Tensor | None  # per-head norms of q and k (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None
    rotary: FusedRotaryEmbedding  # the layer's tables (Gemma 3's local layers have their own)

    @property
    def norm_dtypes(self) -> set[torch.dtype]:
        """Its norms' weights' dtypes: the model's, or float32 (Gemma's, scaling before the rounding)."""
        norms = (
            self.input_norm,
            self.post_norm,
            self.post_attn_norm,
            self.post_ff_norm,
            self.q_norm,
            self.k_norm,
        )
        return {w.dtype for w in norms if w is not None}

    @staticmethod
    def of(layer: LayerModules, rotary: nn.Module) -> StackLayer | None:
        """``layer``'s weights (``rotary``: the model's, where the layer has none of its own), or None where
        a module is not the fast path the stack reproduces."""
        projections = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        optional_norms = (layer.post_attn_norm, layer.post_ff_norm, layer.q_norm, layer.k_norm)
        norms = [layer.input_norm, layer.post_norm, *(m for m in optional_norms if m is not None)]
        layer_rotary = layer.rotary or rotary
        if not (
            all(isinstance(m, Panels) for m in projections)
            and all(isinstance(m, FusedRMSNorm) for m in norms)
            and isinstance(layer.act_fn, FusedSiLUMul | FusedGeluTanhMul)
            and isinstance(layer_rotary, FusedRotaryEmbedding)
        ):
            return None
        qkv, o, gate_up, down = (m for m in projections if isinstance(m, Panels))
        input_norm, post_norm = cast(FusedRMSNorm, layer.input_norm), cast(FusedRMSNorm, layer.post_norm)
        return StackLayer(
            input_norm.weight, qkv, o, post_norm.weight, gate_up, down, layer.rotates, layer.sliding_window,
            _weight(layer.post_attn_norm), _weight(layer.post_ff_norm), isinstance(layer.act_fn, FusedGeluTanhMul),
            _weight(layer.q_norm), _weight(layer.k_norm), layer_rotary,
        )  # fmt: skip

    def struct(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> _Layer:
        projections = (self.qkv, self.o, self.gate_up, self.down)
        floats = [_packed(m) for m in projections]
        quantized = [_quantized(m) for m in projections]
        return _Layer(
            _ptr_of(self.input_norm), _ptr_of(floats[0]), _ptr_of(self.qkv.bias), _ptr_of(floats[1]),
            _ptr_of(self.o.bias), _ptr_of(self.post_norm), _ptr_of(floats[2]), _ptr_of(floats[3]),
            k_cache.data_ptr(), v_cache.data_ptr(),
            *(_ptr_of(q) for q, _ in quantized), *(offsets for _, offsets in quantized),
            int(self.rotate), self.sliding_window or 0, _ptr_of(self.post_attn_norm), _ptr_of(self.post_ff_norm),
            int(self.gelu), _ptr_of(self.q_norm), _ptr_of(self.k_norm), self.rotary.cos.data_ptr(),
            self.rotary.sin_signed.data_ptr(),
        )  # fmt: skip


class DecodeStack:
    """``ctypes`` binding of ``cbserve_decode_stack`` (arguments as ``CpuDecodeStack.__call__`` passes them)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._fn = lib.cbserve_decode_stack
        self._fn.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64]
        self._fn.restype = ctypes.c_int

    def __call__(self, *args: object) -> int:
        return int(self._fn(*args))


class CpuDecodeStack:
    """The stack bound to one model: ``can_run(inputs, decode_kernel)`` then ``run(inputs, kv_cache)``, as
    the runner calls it; the C structs for a KV cache are built on its first step and kept."""

    def __init__(
        self,
        kernel: DecodeStack,
        model: NativeModel,
        layers: list[StackLayer],
        final_norm: FusedRMSNorm,
        rotary: FusedRotaryEmbedding,
        head: Panels,
    ) -> None:
        self.kernel = kernel
        self.model = model
        self.layers = layers
        self.final_norm = final_norm
        self.rotary = rotary
        self.head = head
        self._tables: tuple[KVCache, _Model, ctypes.Array[_Layer]] | None = None

    @staticmethod
    def for_model(model: nn.Module) -> CpuDecodeStack | None:
        """The stack for ``model``, or None where it does not apply (not a Llama-family or Gemma model with
        the CPU fast paths in: float32 on the small kernel's panels, bfloat16 on AMX tiles or the AVX512-BF16
        kernel's panels) or cannot be built (the reason is logged)."""
        if not isinstance(model, LlamaForCausalLM | GemmaForCausalLM) or model.dtype not in _MATMULS:
            return None
        table = model.decoder_table()
        layers = [StackLayer.of(layer, table.rotary) for layer in table.layers]
        norm, rotary, head = table.final_norm, table.rotary, model.lm_head
        if not (
            isinstance(norm, FusedRMSNorm)
            and isinstance(rotary, FusedRotaryEmbedding)
            and isinstance(head, Panels)
        ):
            return None
        stack_layers = [layer for layer in layers if layer is not None]
        projections = [p for layer in stack_layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        projections.append(head)
        if len(stack_layers) < len(layers) or not any(
            all(isinstance(p, kind) for p in projections) for kind in _MATMULS[model.dtype]
        ):
            return None
        if any(layer.norm_dtypes != {norm.weight.dtype} for layer in stack_layers):
            return None  # NOTE: the C step takes one dtype for every norm's weight (the final norm's)
        try:
            kernel = load()
        except KernelUnavailable as e:
            logger.warning("decode steps run layer by layer (%s)", e)
            return None
        return CpuDecodeStack(kernel, model, stack_layers, norm, rotary, head)

    def can_run(self, inputs: BatchInputs, decode_kernel: DecodeKernel | None) -> bool:
        """Every sequence computes one token, decode attention is the CPU kernel's, and every projection
        would take cbserve's kernel (the output head decides: the small kernel's panels and the AMX tiles
        take every call)."""
        num_seqs = inputs.num_seqs
        return (
            decode_kernel is not None
            and decode_kernel.name == "cpu"
            and 0 < num_seqs == inputs.num_decode_seqs == inputs.num_tokens
            and self.head.takes(num_seqs)
        )

    @torch.inference_mode()
    def run(self, inputs: BatchInputs, kv_cache: KVCache, num_layers: int | None = None) -> torch.Tensor:
        """The model's forward for a step that ``can_run``: fp32 logits ``[num_logits, vocab]``
        (``num_layers``: the first layers only, as ``LlamaForCausalLM.forward`` takes it)."""
        x = self.model.embed(inputs.input_ids)  # [num_seqs, hidden]
        h = self(x, inputs, kv_cache, num_layers)  # [num_seqs, hidden], after the final norm
        h = h.index_select(0, inputs.logits_indices)  # [num_logits, hidden] in the caller's order
        return self.model.compute_logits(h)  # [num_logits, vocab]

    def forward(
        self, inputs: BatchInputs, kv_cache: KVCache, decode_kernel: DecodeKernel | None = None
    ) -> torch.Tensor:
        """A step as the runner runs it: in the stack where it ``can_run``, else the model layer by layer
        (for drivers without a scheduler: the model tests, bench/decode_stack_ab.py)."""
        if self.can_run(inputs, decode_kernel):
            return self.run(inputs, kv_cache)
        return self.model(inputs, kv_cache, decode_kernel)

    def _describe(self, kv_cache: KVCache) -> tuple[_Model, ctypes.Array[_Layer]]:
        """The C structs for ``kv_cache`` (kept: the model and the cache do not move)."""
        if self._tables is not None and self._tables[0] is kv_cache:
            return self._tables[1], self._tables[2]
        cfg = self.model.config
        dtype = self.model.dtype
        if kv_cache.dtype != dtype or kv_cache.num_layers < len(self.layers):
            raise ValueError(f"the decode stack needs a {dtype} KV cache with one K and V per layer")
        layers = (_Layer * len(self.layers))()
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_cache.k_caches[i], kv_cache.v_caches[i]
            if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                raise ValueError("the decode stack needs contiguous K and V caches")
            layers[i] = layer.struct(k_cache, v_cache)
        desc = _Model(
            len(self.layers), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, kv_cache.num_blocks, kv_cache.block_size,
            self.rotary.cos.shape[0], cfg.rms_norm_eps, cfg.attention_scale, cfg.attn_logit_softcapping or 0.0,
            self.final_norm.weight.data_ptr(), int(dtype == torch.bfloat16),
            int(self.final_norm.weight.dtype == torch.float32), int(isinstance(self.head, Bf16PanelLinear | QuantBf16PanelLinear)),
        )  # fmt: skip
        self._tables = (kv_cache, desc, layers)
        return desc, layers

    def __call__(
        self, x: torch.Tensor, inputs: BatchInputs, kv_cache: KVCache, num_layers: int | None = None
    ) -> torch.Tensor:
        """The final norm's output ``[num_seqs, hidden]`` for ``x``, the embeddings of a batch where every
        sequence computes one token (``inputs.num_decode_seqs == inputs.num_seqs``), writing their K/V
        (``num_layers``: through the first layers only)."""
        desc, layers = self._describe(kv_cache)
        if num_layers is not None:
            desc = _Model.from_buffer_copy(desc)
            desc.num_layers = min(num_layers, len(self.layers))
        num_seqs, hidden = x.shape
        if inputs.num_decode_seqs != num_seqs or inputs.num_seqs != num_seqs:
            raise ValueError("the decode stack takes batches of one new token per sequence")
        if x.dtype != self.model.dtype or not x.is_contiguous():
            raise ValueError(f"the decode stack needs contiguous {self.model.dtype} embeddings")
        tables = (
            inputs.block_tables if inputs.block_tables.stride(1) == 1 else inputs.block_tables.contiguous()
        )
        out = torch.empty(num_seqs, hidden, dtype=x.dtype)
        rc = self.kernel(
            ctypes.byref(desc), layers, out.data_ptr(), x.data_ptr(), inputs.positions.data_ptr(),
            inputs.slot_mapping.data_ptr(), tables.data_ptr(), tables.stride(0), inputs.seq_lens.data_ptr(),
            num_seqs,
        )  # fmt: skip
        if rc == 0:
            return out
        raise {
            -1: MemoryError("decode stack: out of memory for its scratch buffers"),
            -2: ValueError("decode stack: a head or block shape the attention kernel does not take"),
            -3: ValueError(
                f"decode stack: a slot outside the cache's {desc.num_blocks * desc.block_size} slots"
            ),
            -4: IndexError(f"decode stack: a position outside the rotary table of {desc.max_positions}"),
            -5: ValueError("decode stack: a sequence length or block table entry outside the cache"),
        }.get(rc, RuntimeError(f"decode stack failed with code {rc}"))


# Built once per process; raises ``KernelUnavailable`` with the reason when it cannot be.
load = BuildOnce(SOURCE, DecodeStack)
