"""The Llama family as one decoder-only transformer: Llama 2/3 (llama3 RoPE scaling), SmolLM, TinyLlama,
Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3 (per-head RMSNorm of q and k before the rotation),
Granite (scaled embeddings, residual branches, attention and logits), SmolLM3 (some layers without
rotary embeddings: "NoPE"), Phi-3 (fused q/k/v and gate/up in the checkpoint).

    h = embed(ids)
    for each layer:  h = h + attn(rms_norm(h));  h = h + mlp(rms_norm(h))
    logits = lm_head(rms_norm(h[logits_indices]))

The loop carries ``h`` as (residual, the last block's output), as vLLM does, so that each "add, then
norm" is one step (``RMSNorm.add_and_norm``), which a fused CPU op can do in one pass.

The forward takes ONE flattened ragged batch (``BatchInputs``): prefill chunks and decode tokens of many
sequences, concatenated. Attention reads and writes the paged ``KVCache`` (engine/executor/attention/paged.py).
q/k/v and gate/up are fused into one matmul each at load time, q and k are rotated in one op, and the
attention's batch metadata is built once per forward. This file is the architecture only: the CPU's fast
paths are modules swapped in after loading (engine/executor/fast_paths.py), and the decode stack runs
whole decode steps from the table ``decoder_table`` exports (engine/executor/decode_stack.py). The embedding,
the final norm, the head and the weights table are every native model's (engine/executor/models/decoder_only.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from engine.executor import dola
from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.attention.paged import PagedAttentionMetadata, paged_attention
from engine.executor.inputs import BatchInputs
from engine.executor.kv_cache import KVCache
from engine.executor.models.decoder_only import (
    DecoderOnlyLM,
    WeightSlots,
    dense,
)
from engine.executor.models.layers import (
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    RotaryInputs,
)
from engine.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_index: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = config.attention_scale
        self.softcap = config.attn_logit_softcapping  # Gemma 2's
        self.rotates = layer_index not in config.no_rope_layers  # SmolLM3's NoPE layers do not
        hidden = config.hidden_size
        # Rows of qkv_proj: [0, q_size) q, then k, then v (filled from q_proj/k_proj/v_proj).
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, config.attention_bias, dtype, device)
        # NOTE: Qwen2's flag only adds q/k/v biases; Llama's and Qwen3's attention_bias also biases o_proj.
        o_bias = config.attention_bias and config.architecture != "qwen2"
        self.o_proj = Linear(self.q_size, hidden, o_bias, dtype, device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            norm = (self.head_dim, config.rms_norm_eps, dtype, device, config.norms_scale_in_float32)
            self.q_norm, self.k_norm = RMSNorm(*norm), RMSNorm(*norm)

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
            qk = torch.cat(
                (self.q_norm(q), self.k_norm(k)), dim=1
            )  # [num_tokens, heads + kv_heads, head_dim]
        if self.rotates:
            qk = rotary.rotate_with(qk, rotation)  # [num_tokens, heads + kv_heads, head_dim]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(
            q, k, v, k_cache, v_cache, meta, self.scale, self.softcap
        )  # [num_tokens, heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))  # [num_tokens, hidden]


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_index: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, layer_index, dtype, device)
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


@dataclass(frozen=True)
class LayerModules:
    """One decoder layer's modules in the order they run, as loaded or as swapped.
    ``post_norm`` is the norm before the MLP (Gemma's pre-feedforward norm); Gemma also norms the
    attention's and the MLP's outputs (``post_attn_norm``, ``post_ff_norm``); Qwen3 and Gemma 3 norm q and k
    per head (``q_norm``, ``k_norm``); ``rotary``: the layer's own rotary embedding (Gemma 3's local
    layers), None for the model's."""

    input_norm: nn.Module
    qkv_proj: nn.Module
    o_proj: nn.Module
    post_norm: nn.Module
    gate_up_proj: nn.Module
    act_fn: nn.Module
    down_proj: nn.Module
    rotates: bool = True  # False: attention without rotary embeddings (SmolLM3's NoPE layers)
    sliding_window: int | None = None  # the layer's window (None: the whole context)
    post_attn_norm: nn.Module | None = None
    post_ff_norm: nn.Module | None = None
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None
    rotary: nn.Module | None = None


@dataclass(frozen=True)
class DecoderTable:
    """The decoder flat: its layers, the final norm and the rotary embedding. What an executor that runs a
    whole step in one kernel reads its weights from (engine/executor/decode_stack.py)."""

    layers: tuple[LayerModules, ...]
    final_norm: nn.Module
    rotary: nn.Module


class LlamaForCausalLM(DecoderOnlyLM):
    """``forward(inputs, kv_cache) -> logits [num_logits, vocab]`` (fp32) over one ragged batch."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(config, dtype, device, DecoderLayer)

    def scale_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        multiplier = self.config.embedding_multiplier  # Granite's
        return x if multiplier == 1.0 else x * multiplier

    def transform_logits(self, logits: torch.Tensor) -> torch.Tensor:
        scaling = self.config.logits_scaling  # Granite's
        return logits if scaling == 1.0 else logits / scaling

    @torch.inference_mode()
    def forward(
        self,
        inputs: BatchInputs,
        kv_cache: KVCache,
        decode_kernel: DecodeKernel | None = None,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Compute the batch's new tokens, writing their K/V into ``inputs.slot_mapping`` slots, and return
        fp32 logits ``[len(inputs.logits_indices), vocab_size]`` for the ``logits_indices`` rows only.
        ``decode_kernel``: the decode-attention kernel (engine/executor/attention/backend.py), or None for SDPA.
        ``num_layers``: only the first layers, then the final norm and the head (self-speculative drafting,
        LayerSkip's early exit; their K/V only is written)."""
        return self.forward_with_hidden(inputs, kv_cache, decode_kernel, num_layers)[0]

    # contrastive search: ``forward_with_hidden`` gives the final norm's output of ``BatchInputs.hidden_indices``
    supports_hidden_states = True

    @torch.inference_mode()
    def forward_with_hidden(
        self,
        inputs: BatchInputs,
        kv_cache: KVCache,
        decode_kernel: DecodeKernel | None = None,
        num_layers: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``'s logits, and the final norm's output ``[len(hidden_indices), hidden]`` (the model's
        dtype) of the rows ``inputs.hidden_indices`` names (None when it names none)."""
        layers = self.model.layers if num_layers is None else self.model.layers[:num_layers]
        logits_rows = inputs.logits_indices
        num_logits = int(logits_rows.shape[0])
        hidden_rows = inputs.hidden_indices
        rows = logits_rows if hidden_rows is None else torch.cat([logits_rows, hidden_rows])
        exits = ExitTaps(inputs.early_exits, logits_rows)
        meta = PagedAttentionMetadata.build(
            inputs, self.config.num_queries_per_kv, self.dtype, self.config.sliding_window, decode_kernel
        )
        rotation = self.rotary.prepare(inputs.positions)
        x = self.embed(inputs.input_ids)  # [num_tokens, hidden]
        residual: torch.Tensor | None = None
        # Past the last layer's attention only the rows that need logits matter (llama.cpp's "skip unused
        # tokens"): a prefill chunk's other rows skip its o_proj and MLP.
        pruned = rows.shape[0] < inputs.input_ids.shape[0] and len(layers) > 0
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            exits.tap(i, x, residual)  # DoLa: the stream entering layer i, for the rows that contrast it
            layer_rows = rows if pruned and i == last else None
            x, residual = layer(
                x,
                residual,
                self.rotary,
                rotation,
                kv_cache.k_caches[i],
                kv_cache.v_caches[i],
                meta,
                layer_rows,
            )
        h = self.final_norm(x, residual, rows, pruned)  # [num_logits + num_hidden, hidden]
        logits = self.compute_logits(h[:num_logits])  # [num_logits, vocab]
        hidden = h[num_logits:] if hidden_rows is not None else None
        return (exits.contrast(logits, self.lm_head) if exits else logits), hidden

    # DoLa: ``forward`` gives the contrast of the layers ``BatchInputs.early_exits`` names (engine/executor/dola.py)
    supports_early_exits = True

    def decoder_table(self) -> DecoderTable:
        """The decoder's modules, flat (see ``DecoderTable``)."""
        layers = []
        for module in self.model.layers:
            layer = cast(DecoderLayer, module)
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(
                LayerModules(
                    layer.input_layernorm, attn.qkv_proj, attn.o_proj, layer.post_attention_layernorm,
                    mlp.gate_up_proj, mlp.act_fn, mlp.down_proj, attn.rotates, self.config.sliding_window,
                    q_norm=attn.q_norm, k_norm=attn.k_norm,
                )
            )  # fmt: skip
        return DecoderTable(tuple(layers), self.model.norm, self.rotary)

    # ------------------------------------------------------------------ weights
    def layer_slots(self, prefix: str, module: nn.Module) -> WeightSlots:
        """q/k/v and gate/up into their fused matrices (or Phi-3's fused tensors), o/down, q/k norms, the
        two norms."""
        layer = cast(DecoderLayer, module)
        fused = self.config.checkpoint_fuses_projections
        slots = attention_slots(prefix, layer.self_attn, fused) | mlp_slots(prefix, layer.mlp, fused)
        for name, norm in (
            ("input", layer.input_layernorm),
            ("post_attention", layer.post_attention_layernorm),
        ):
            slots[f"{prefix}{name}_layernorm.weight"] = (norm.weight, 0, norm.weight.shape[0])
        return slots

    def fold_into_weights(self) -> None:
        """Granite adds each block's output times ``residual_multiplier`` to the residual stream. The block
        ends in a linear map (o_proj, down_proj), so its weights take the factor here, once:
        ``m * (W x + b) = (m W) x + m b``; the layers' code and the fused kernels stay Llama's."""
        multiplier = self.config.residual_multiplier
        if multiplier == 1.0:
            return
        for module in self.model.layers:
            layer = cast(DecoderLayer, module)
            for proj in (dense(layer.self_attn.o_proj), dense(layer.mlp.down_proj)):
                proj.weight.mul_(multiplier)
                if proj.bias is not None:
                    proj.bias.mul_(multiplier)


def attention_slots(prefix: str, attn: Attention, fused: bool) -> dict[str, tuple[torch.Tensor, int, int]]:
    """The checkpoint names (under ``prefix``, "model.layers.{i}.") of ``attn``'s tensors -> (parameter,
    first row, end row): q/k/v (or Phi-3's ``qkv_proj``: ``fused``) into the fused qkv_proj, o_proj, the
    q/k norms."""
    qkv_proj, o_proj = dense(attn.qkv_proj), dense(attn.o_proj)
    q, kv = attn.q_size, attn.kv_size
    qkv_rows = (
        {"qkv": (0, q + 2 * kv)} if fused else {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
    )
    slots: dict[str, tuple[torch.Tensor, int, int]] = {}
    for proj, (start, end) in qkv_rows.items():
        slots[f"{prefix}self_attn.{proj}_proj.weight"] = (qkv_proj.weight, start, end)
        if qkv_proj.bias is not None:
            slots[f"{prefix}self_attn.{proj}_proj.bias"] = (qkv_proj.bias, start, end)
    params = {"o_proj.weight": o_proj.weight, "o_proj.bias": o_proj.bias}
    if attn.q_norm is not None and attn.k_norm is not None:
        params.update({"q_norm.weight": attn.q_norm.weight, "k_norm.weight": attn.k_norm.weight})
    for name, param in params.items():
        if param is not None:
            slots[f"{prefix}self_attn.{name}"] = (param, 0, param.shape[0])
    return slots


def mlp_slots(prefix: str, mlp: GatedMLP, fused: bool) -> dict[str, tuple[torch.Tensor, int, int]]:
    """As ``attention_slots`` for the MLP: gate and up (or Phi-3's ``gate_up_proj``) into the fused
    gate_up_proj, and down_proj."""
    gate_up, down, inter = (
        dense(mlp.gate_up_proj).weight,
        dense(mlp.down_proj).weight,
        mlp.intermediate_size,
    )
    slots: dict[str, tuple[torch.Tensor, int, int]] = {
        f"{prefix}mlp.down_proj.weight": (down, 0, down.shape[0])
    }
    if fused:
        slots[f"{prefix}mlp.gate_up_proj.weight"] = (gate_up, 0, 2 * inter)  # gate rows, then up rows
    else:
        slots[f"{prefix}mlp.gate_proj.weight"] = (gate_up, 0, inter)
        slots[f"{prefix}mlp.up_proj.weight"] = (gate_up, inter, 2 * inter)
    return slots


class ExitTaps:
    """The hidden states DoLa reads in one forward: for each row of ``early_exits`` (a logits row and its
    candidate layers), the residual stream entering each of those layers at the row's token (transformers'
    ``hidden_states[l]``: the embedding for l = 0), then ``contrast`` replaces the row's logits."""

    def __init__(self, early_exits: tuple[tuple[int, tuple[int, ...]], ...], rows: torch.Tensor) -> None:
        self.early_exits = early_exits
        self.tokens = (
            rows[torch.tensor([r for r, _ in early_exits], dtype=torch.long, device=rows.device)]
            if early_exits
            else rows
        )
        self.wanted = {layer for _, layers in early_exits for layer in layers}
        self.states: dict[int, torch.Tensor] = {}  # layer -> [len(early_exits), hidden]

    def __bool__(self) -> bool:
        return bool(self.early_exits)

    def tap(self, layer: int, x: torch.Tensor, residual: torch.Tensor | None) -> None:
        if layer in self.wanted:
            stream = x[self.tokens] if residual is None else x[self.tokens] + residual[self.tokens]
            self.states[layer] = stream

    def contrast(self, logits: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        out = logits.clone()
        for k, (row, layers) in enumerate(self.early_exits):
            premature = torch.stack([self.states[layer][k] for layer in layers])  # [layers, hidden]
            out[row] = dola.contrast(logits[row], lm_head(premature).float())
        return out
