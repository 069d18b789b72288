"""The decoder layers of a CPU decode step in one C call (``kernels/csrc/decode_stack.c``).

A decode step of a small model on a few cores is ~300 short C calls when run layer by layer from Python:
the matmuls (engine/executor/kernels/small_gemm.py), decode attention (engine/executor/attention/cpu_kernel.py) and the
fused element-wise ops (engine/executor/kernels/cpu_ops.py). Between them one thread runs Python while the other
waits in OpenMP's barrier. ``DecodeStack`` runs the same kernels, in the same order, for every layer in one
parallel region: the result is that of the layer-by-layer path (``tests/model/test_decode_stack.py``).

It takes float32 models whose projections are all in the small kernel's panels, with the fused CPU ops,
no per-head q/k norms, and steps where every sequence computes one token with the CPU decode kernel
(``LlamaForCausalLM.forward`` checks). Everything else runs layer by layer.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from engine.cpu.native_build import BuildOnce
from engine.executor.inputs import BatchInputs
from engine.executor.kernels.small_gemm import has_offsets
from engine.executor.kv_cache import KVCache

if TYPE_CHECKING:
    from engine.executor.models.llama import DecoderLayer, LlamaForCausalLM

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
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, _i64) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim")),
        *((name, _i64) for name in ("intermediate", "num_blocks", "block_size", "sliding_window")),
        ("max_positions", _i64),
        ("eps", _f32),
        ("scale", _f32),
        ("cos", _ptr),
        ("sin_signed", _ptr),
        ("final_norm", _ptr),
    ]


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecodeStack:
    """``ctypes`` binding of ``cbserve_decode_stack``; ``bind`` it to a model once, call it per step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._fn = lib.cbserve_decode_stack
        self._fn.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64]
        self._fn.restype = ctypes.c_int

    def bind(self, model: LlamaForCausalLM) -> BoundDecodeStack:
        return BoundDecodeStack(self, model)


class BoundDecodeStack:
    """The stack of one model: its weights' addresses gathered once; the KV cache's on first use."""

    def __init__(self, stack: DecodeStack, model: LlamaForCausalLM) -> None:
        self.stack = stack
        self.model = model
        self._tables: tuple[KVCache, _Model, ctypes.Array[_Layer]] | None = None

    def _describe(self, kv_cache: KVCache) -> tuple[_Model, ctypes.Array[_Layer]]:
        """The C structs for ``kv_cache`` (kept: the model and the cache do not move)."""
        if self._tables is not None and self._tables[0] is kv_cache:
            return self._tables[1], self._tables[2]
        model, cfg = self.model, self.model.config
        if kv_cache.dtype != torch.float32 or kv_cache.num_layers < len(model.model.layers):
            raise ValueError("the decode stack needs a float32 KV cache with one K and V per layer")
        layers = (_Layer * len(model.model.layers))()
        for i, module in enumerate(model.model.layers):
            layer = cast("DecoderLayer", module)
            attn, mlp = layer.self_attn, layer.mlp
            k_cache, v_cache = kv_cache.k_caches[i], kv_cache.v_caches[i]
            if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                raise ValueError("the decode stack needs contiguous K and V caches")
            quantized = [m.small_qpacked for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            layers[i] = _Layer(
                _ptr_of(layer.input_layernorm.weight), _ptr_of(attn.qkv_proj.small_packed),
                _ptr_of(attn.qkv_proj.bias), _ptr_of(attn.o_proj.small_packed), _ptr_of(attn.o_proj.bias),
                _ptr_of(layer.post_attention_layernorm.weight), _ptr_of(mlp.gate_up_proj.small_packed),
                _ptr_of(mlp.down_proj.small_packed), k_cache.data_ptr(), v_cache.data_ptr(),
                *(_ptr_of(q) for q in quantized), *(int(q is not None and has_offsets(q)) for q in quantized),
            )  # fmt: skip
        rotary = model.rotary
        desc = _Model(
            len(model.model.layers), cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, kv_cache.num_blocks, kv_cache.block_size,
            cfg.sliding_window or 0, rotary.cos.shape[0], cfg.rms_norm_eps, cfg.head_dim**-0.5,
            rotary.cos.data_ptr(), rotary.sin_signed.data_ptr(), model.model.norm.weight.data_ptr(),
        )  # fmt: skip
        self._tables = (kv_cache, desc, layers)
        return desc, layers

    def __call__(self, x: torch.Tensor, inputs: BatchInputs, kv_cache: KVCache) -> torch.Tensor:
        """The final norm's output ``[num_seqs, hidden]`` for ``x``, the embeddings of a batch where every
        sequence computes one token (``inputs.num_decode_seqs == inputs.num_seqs``), writing their K/V."""
        desc, layers = self._describe(kv_cache)
        num_seqs, hidden = x.shape
        if inputs.num_decode_seqs != num_seqs or inputs.num_seqs != num_seqs:
            raise ValueError("the decode stack takes batches of one new token per sequence")
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError("the decode stack needs contiguous float32 embeddings")
        tables = (
            inputs.block_tables if inputs.block_tables.stride(1) == 1 else inputs.block_tables.contiguous()
        )
        out = torch.empty(num_seqs, hidden, dtype=torch.float32)
        rc = self.stack._fn(
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
