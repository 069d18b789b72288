"""The Llama family as one decoder-only transformer: Llama 2/3 (llama3 RoPE scaling), SmolLM, TinyLlama,
Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (per-head RMSNorm of q and k before the rotation).

    h = embed(ids)
    for each layer:  h = h + attn(rms_norm(h));  h = h + mlp(rms_norm(h))
    logits = lm_head(rms_norm(h[logits_indices]))

The loop carries ``h`` as (residual, the last block's output), as vLLM does, so that each "add, then
norm" is one fused op on the CPU (``add_and_norm``; engine/executor/kernels/cpu_ops.py).

The forward takes ONE flattened ragged batch (``BatchInputs``): prefill chunks and decode tokens of many
sequences, concatenated. Attention reads and writes the paged ``KVCache`` (engine/executor/attention/paged.py).
For speed on CPU (overhead-bound at small batch) q/k/v and gate/up are fused into one matmul each at load
time, q and k are rotated in one op, and the attention's batch metadata is built once per forward.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu import huge_pages
from engine.cpu.native_build import KernelUnavailable
from engine.errors import ModelLoadError
from engine.executor import decode_stack
from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.attention.paged import PagedAttentionMetadata, paged_attention
from engine.executor.decode_stack import BoundDecodeStack
from engine.executor.inputs import BatchInputs
from engine.executor.kernels import cpu_ops, prepacked, small_gemm
from engine.executor.kernels.block_codes import BlockCodes
from engine.executor.kernels.cpu_ops import CpuOps
from engine.executor.kernels.small_gemm import SmallGemm
from engine.executor.kv_cache import KVCache
from engine.executor.models.layers import (
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    RotaryInputs,
    empty_param,
)
from engine.model_config import ModelConfig

logger = logging.getLogger(__name__)


class WeightMismatchError(ModelLoadError, ValueError):
    """The checkpoint's tensors do not match the model: one is missing, unexpected or mis-shaped."""


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        # Rows of qkv_proj: [0, q_size) q, then k, then v (filled from q_proj/k_proj/v_proj).
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, config.attention_bias, dtype, device)
        # NOTE: Qwen2's flag only adds q/k/v biases; Llama's and Qwen3's attention_bias also biases o_proj.
        o_bias = config.attention_bias and config.architecture != "qwen2"
        self.o_proj = Linear(self.q_size, hidden, o_bias, dtype, device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        rotary: RotaryEmbedding,
        rotation: RotaryInputs,
        k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim, block_size]
        v_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        meta: PagedAttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, -1)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)  # [num_tokens, heads + kv_heads, head_dim]
        qk = rotary.rotate_with(qk, rotation)  # [num_tokens, heads + kv_heads, head_dim]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # [num_tokens, heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))  # [num_tokens, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype, device)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the previous layer's MLP output (the embeddings at layer 0)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: h before that MLP output (None at layer 0)
        rotary: RotaryEmbedding,
        rotation: RotaryInputs,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: PagedAttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, h before it); h after the layer is their sum. With ``rows``,
        every token's K/V is still written, but only those rows go on past the attention (and are returned)."""
        if residual is None:
            normed, residual = self.input_layernorm(x), x
        else:
            normed, residual = self.input_layernorm.add_and_norm(x, residual)  # h = residual + x
        attn = self.self_attn(normed, rotary, rotation, k_cache, v_cache, meta)
        if rows is not None:
            attn, residual = attn[rows], residual[rows]
        normed, residual = self.post_attention_layernorm.add_and_norm(attn, residual)  # h = h + attn
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    """The decoder stack without the output head (named as in HF checkpoints: ``model.*``)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    """``forward(inputs, kv_cache) -> logits [num_logits, vocab]`` (fp32) over one ragged batch."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.device = device
        self.model = LlamaModel(config, dtype, device)
        self.lm_head = (
            self.model.embed_tokens
            if config.tie_word_embeddings
            else empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, dtype, device
        )
        self.small: SmallGemm | None = None
        # The output head as a prepacked Linear once ``prepack_weights`` ran (its weights moved like any other).
        self.packed_head: Linear | None = None
        self.decode_stack: BoundDecodeStack | None = None  # set by ``use_decode_stack``

    def prepack_weights(self, blocks: Mapping[str, BlockCodes] | None = None) -> bool:
        """On a CPU with oneDNN, move every projection and the output head into oneDNN's prepacked layout
        (engine/executor/kernels/prepacked.py); the embedding stays dense (an untied head's dense copy is freed).
        In float32 they are also packed for the small-batch kernel (engine/executor/kernels/small_gemm.py), which
        decode steps use: a second copy of the weights; where that kernel takes every batch (CPUs without
        AVX-512) it is the only copy. A matrix whose checkpoint tensors are in ``blocks`` (by Hugging Face
        name, as the GGUF loader gives them), and whose loaded weights are their ``dequantize()`` bit for
        bit, is also packed in its blocks for steps of a few rows: the same results from a third to a
        quarter of the bytes. Call after ``load_weights``, which cannot run afterwards. Returns whether it
        packed."""
        if not prepacked.can_prepack(self.device, self.dtype):
            return False
        if self.is_prepacked:
            return True
        if small_gemm.supports(self.device, self.dtype):
            try:
                self.small = small_gemm.load()
            except KernelUnavailable as e:
                logger.warning("the small-batch matmul kernel is not used (%s); oneDNN runs decode steps", e)
        onednn = self.small is None or not small_gemm.takes_every_batch()
        head = Linear(self.config.hidden_size, self.config.vocab_size, False, self.dtype, self.device)
        head.weight = nn.Parameter(self.lm_head.detach(), requires_grad=False)  # the (tied) head's weights
        self.packed_head = head
        linears = [m for m in self.modules() if isinstance(m, Linear)]  # the head included
        panels: list[torch.Tensor | None] = [None] * len(linears)
        codes: list[BlockCodes | None] = [None] * len(linears)
        qpanels: list[torch.Tensor | None] = [None] * len(linears)
        if self.small is not None:  # all panels in one allocation on huge pages (engine/cpu/huge_pages.py)
            codes = self._block_codes(linears, blocks or {})
            shapes = [SmallGemm.packed_shape(m.out_features, m.in_features) for m in linears]
            qshapes = [
                SmallGemm.qpacked_shape(m.out_features, m.in_features, c.offsets is not None)
                for m, c in zip(linears, codes, strict=True)
                if c is not None
            ]
            dtypes = [torch.float32] * len(shapes) + [torch.uint8] * len(qshapes)
            arena = iter(huge_pages.empty_many([*shapes, *qshapes], dtypes))
            panels = [next(arena) for _ in shapes]
            qpanels = [None if c is None else next(arena) for c in codes]
        for module, out, c, qout in zip(linears, panels, codes, qpanels, strict=True):
            module.prepack(self.small, onednn, out, c, qout)
        if not self.config.tie_word_embeddings:
            self.lm_head = empty_param(0, dtype=self.dtype, device=self.device)
        return True

    def _block_codes(self, linears: list[Linear], blocks: Mapping[str, BlockCodes]) -> list[BlockCodes | None]:
        """Per Linear: its weight as ``blocks`` hold it (the fused ones' parts in row order), or None where a
        part is missing, parts mix kinds, or the blocks do not give the loaded weight bit for bit."""
        parts: dict[int, list[tuple[int, int, BlockCodes]]] = {}
        for name, (param, start, end) in self._weight_slots().items():
            if name in blocks:
                parts.setdefault(param.data_ptr(), []).append((start, end, blocks[name]))
        result: list[BlockCodes | None] = []
        for module in linears:
            pieces = sorted(parts.get(module.weight.data_ptr(), []), key=lambda piece: piece[0])
            starts = [0] + [end for _, end, _ in pieces]
            whole = bool(pieces) and [s for s, _, _ in pieces] == starts[:-1] and starts[-1] == module.out_features
            joined = BlockCodes.cat([c for _, _, c in pieces]) if whole else None
            if joined is not None and torch.equal(joined.dequantize(), module.weight.detach()):
                result.append(joined)
            else:
                result.append(None)
        return result

    def use_cpu_ops(self) -> bool:
        """Run RMSNorm (with its residual add), the rotary embedding and the MLP's activation in the fused
        CPU ops of engine/executor/kernels/cpu_ops.py. Returns whether they are used: only on the CPU, in float32 or
        bfloat16, where the ops could be built (else the reason is logged and PyTorch runs them)."""
        if not CpuOps.supports(self.device, self.dtype):
            return False
        try:
            ops = cpu_ops.load()
        except KernelUnavailable as e:
            logger.warning("the fused CPU ops are not used (%s); PyTorch runs them", e)
            return False
        for module in self.modules():
            if isinstance(module, RMSNorm | RotaryEmbedding | GatedMLP):
                module.cpu_ops = ops
        return True

    def use_decode_stack(self) -> bool:
        """Run the layers of decode steps in one C call (engine/executor/decode_stack.py) where they would
        otherwise be the small kernel's matmuls, the fused CPU ops and the CPU decode kernel: float32 on the
        CPU, after ``prepack_weights`` and ``use_cpu_ops``, without per-head q/k norms. Returns whether it
        is used (else the reason is logged where the kernel could not be built)."""
        if self.small is None or not self.uses_cpu_ops or self.config.qk_norm or self.dtype != torch.float32:
            return False
        try:
            self.decode_stack = decode_stack.load().bind(self)
        except KernelUnavailable as e:
            logger.warning("decode steps run layer by layer (%s)", e)
            return False
        return True

    def _runs_decode_stack(self, inputs: BatchInputs, decode_kernel: DecodeKernel | None) -> bool:
        """Whether this step goes to the decode stack: every sequence computes one token, decode attention
        is the CPU kernel's, and every projection would take the small kernel (``Linear.forward``: all of
        them where oneDNN holds no copy of the weights, else at most ``small_gemm.MAX_ROWS`` rows)."""
        num_seqs = inputs.num_seqs
        return (
            self.decode_stack is not None
            and decode_kernel is not None
            and decode_kernel.name == "cpu"
            and 0 < num_seqs == inputs.num_decode_seqs == inputs.num_tokens
            and (self.lm_head_packed is None or num_seqs <= small_gemm.MAX_ROWS)
        )

    def _decode_with_stack(self, inputs: BatchInputs, kv_cache: KVCache) -> torch.Tensor:
        """``forward`` of a step that ``_runs_decode_stack``: the layers and the final norm in one C call."""
        assert self.decode_stack is not None and self.packed_head is not None  # use_decode_stack set both
        x = F.embedding(inputs.input_ids, self.model.embed_tokens)  # [num_seqs, hidden]
        h = self.decode_stack(x, inputs, kv_cache)  # [num_seqs, hidden], after the final norm
        h = h.index_select(0, inputs.logits_indices)  # [num_logits, hidden] in the caller's order
        return self.packed_head(h).float()  # [num_logits, vocab]

    @property
    def uses_cpu_ops(self) -> bool:
        return self.rotary.cpu_ops is not None

    @property
    def uses_small_gemm(self) -> bool:
        return self.small is not None

    @property
    def is_prepacked(self) -> bool:
        return self.packed_head is not None

    @property
    def lm_head_packed(self) -> torch.Tensor | None:
        """The output head in oneDNN's layout, if it was put there."""
        return None if self.packed_head is None else self.packed_head.packed

    @property
    def lm_head_small(self) -> torch.Tensor | None:
        """The output head in the small kernel's panels, if it was put there."""
        return None if self.packed_head is None else self.packed_head.small_packed

    @torch.inference_mode()
    def forward(
        self, inputs: BatchInputs, kv_cache: KVCache, decode_kernel: DecodeKernel | None = None
    ) -> torch.Tensor:
        """Compute the batch's new tokens, writing their K/V into ``inputs.slot_mapping`` slots, and return
        fp32 logits ``[len(inputs.logits_indices), vocab_size]`` for the ``logits_indices`` rows only.
        ``decode_kernel``: the decode-attention kernel (engine/executor/attention/backend.py), or None for SDPA."""
        if self._runs_decode_stack(inputs, decode_kernel):
            return self._decode_with_stack(inputs, kv_cache)
        rows = inputs.logits_indices
        meta = PagedAttentionMetadata.build(
            inputs, self.config.num_queries_per_kv, self.dtype, self.config.sliding_window, decode_kernel
        )
        rotation = self.rotary.prepare(inputs.positions)
        x = F.embedding(inputs.input_ids, self.model.embed_tokens)  # [num_tokens, hidden]
        residual: torch.Tensor | None = None
        # Past the last layer's attention only the rows that need logits matter (llama.cpp's "skip unused
        # tokens"): a prefill chunk's other rows skip its o_proj and MLP.
        pruned = rows.shape[0] < inputs.input_ids.shape[0] and len(self.model.layers) > 0
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            layer_rows = rows if pruned and i == last else None
            x, residual = layer(
                x, residual, self.rotary, rotation, kv_cache.k_caches[i], kv_cache.v_caches[i], meta, layer_rows
            )
        if not pruned:
            x, residual = x[rows], None if residual is None else residual[rows]
        if residual is None:  # no layers
            h = self.model.norm(x)
        else:
            h, _ = self.model.norm.add_and_norm(x, residual)  # [num_logits, hidden]
        if self.packed_head is not None:
            return self.packed_head(h).float()  # [num_logits, vocab]
        return F.linear(h, self.lm_head).float()  # [num_logits, vocab]

    # ------------------------------------------------------------------ weights
    def _weight_slots(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF tensor name -> (our parameter, first row, end row) it fills."""
        cfg = self.config
        slots: dict[str, tuple[torch.Tensor, int, int]] = {}

        def whole(name: str, param: torch.Tensor) -> None:
            slots[name] = (param, 0, param.shape[0])

        whole("model.embed_tokens.weight", self.model.embed_tokens)
        whole("model.norm.weight", self.model.norm.weight)
        if not cfg.tie_word_embeddings:
            whole("lm_head.weight", self.lm_head)
        for i, module in enumerate(self.model.layers):
            layer = cast(DecoderLayer, module)
            p = f"model.layers.{i}."
            attn = layer.self_attn
            q, kv = attn.q_size, attn.kv_size
            qkv_rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
            for proj, (start, end) in qkv_rows.items():
                slots[f"{p}self_attn.{proj}_proj.weight"] = (attn.qkv_proj.weight, start, end)
                if attn.qkv_proj.bias is not None:
                    slots[f"{p}self_attn.{proj}_proj.bias"] = (attn.qkv_proj.bias, start, end)
            whole(f"{p}self_attn.o_proj.weight", attn.o_proj.weight)
            if attn.o_proj.bias is not None:
                whole(f"{p}self_attn.o_proj.bias", attn.o_proj.bias)
            if attn.q_norm is not None and attn.k_norm is not None:
                whole(f"{p}self_attn.q_norm.weight", attn.q_norm.weight)
                whole(f"{p}self_attn.k_norm.weight", attn.k_norm.weight)
            inter = layer.mlp.intermediate_size
            slots[f"{p}mlp.gate_proj.weight"] = (layer.mlp.gate_up_proj.weight, 0, inter)
            slots[f"{p}mlp.up_proj.weight"] = (layer.mlp.gate_up_proj.weight, inter, 2 * inter)
            whole(f"{p}mlp.down_proj.weight", layer.mlp.down_proj.weight)
            whole(f"{p}input_layernorm.weight", layer.input_layernorm.weight)
            whole(f"{p}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        return slots

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model (converting to its dtype and device), filling the fused
        qkv / gate_up matrices from their parts. Raises ``WeightMismatchError`` naming the tensor on a
        missing, unexpected, duplicated or mis-shaped one; ``RuntimeError`` after ``prepack_weights``.
        Rotary ``inv_freq`` buffers are ignored (rebuilt from the config), as is ``lm_head.weight`` when the
        embeddings are tied."""
        if self.is_prepacked:
            raise RuntimeError("load_weights after prepack_weights: the dense weights are gone")
        slots = self._weight_slots()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                if tuple(tensor.shape) != tuple(self.lm_head.shape):
                    raise WeightMismatchError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(self.lm_head.shape)}"
                    )
                continue
            if name not in slots:
                raise WeightMismatchError(
                    f"unexpected tensor {name!r} for a {self.config.architecture} model with "
                    f"{self.config.num_hidden_layers} layers"
                )
            if name in loaded:
                raise WeightMismatchError(f"tensor {name!r} appears twice in the checkpoint")
            param, start, end = slots[name]
            target = param.data[start:end]
            if tuple(tensor.shape) != tuple(target.shape):
                raise WeightMismatchError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(slots) - loaded)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise WeightMismatchError(f"missing tensors in the checkpoint: {', '.join(missing[:5])}{more}")
