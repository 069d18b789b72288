"""Gemma 2 and Gemma 3 (text) as one decoder-only transformer, as the papers draw it:

    h = embed(ids) * sqrt(hidden_size)
    for each layer:  h = h + post_attn_norm(attn(input_norm(h)))
                     h = h + post_ff_norm(mlp(pre_ff_norm(h)))           mlp: down(gelu_tanh(gate) * up)
    logits = softcap(lm_head(norm(h[logits_indices])), final_logit_softcapping)

with every norm an RMSNorm scaled by ``(1 + weight)``, q.k scaled by ``query_pre_attn_scalar ** -0.5``, and
``softcap(x, c) = c * tanh(x / c)``. Layers are local (a sliding window) or global (the whole context):
Gemma 2 alternates them, Gemma 3 has five local layers to one global (``layer_types``), rotates the local
ones with their own RoPE base (``local_rope_theta``) and normalises q and k per head before the rotation.
Gemma 2 also soft-caps the attention scores (``attn_logit_softcapping``, inside the paged attention: the
CPU kernels compute it, and the PyTorch path where SDPA would run).

The attention, the projections, the MLP and the paged KV cache are the Llama code's
(engine/executor/models/llama.py), the embedding, the final norm, the head and the weights table every
native model's (engine/executor/models/decoder_only.py); the batch is the same flattened ragged ``BatchInputs``. Each layer reads
the attention metadata of its window, built once per forward for each window the model has. The CPU fast
paths swap the same modules (engine/executor/fast_paths.py, the GELU gate too); the CPU decode stack
(engine/executor/decode_stack.py) runs the layers from ``decoder_table``.

NOTE: the ``(1 + weight)`` of the norms is added to the loaded weights once (``fold_into_weights``), so the
norms are the Llama code's ``RMSNorm`` and take the fused ops (CPU, Triton). Their weights are float32
(``ModelConfig.norms_scale_in_float32``) in any dtype: the sum is transformers' ``1.0 + weight.float()``,
and the norm is scaled in float32 and rounded once, as transformers' Gemma norms do (in bfloat16 the
Llama order, rounded then scaled by a rounded ``1 + weight``, took the logits twice as far from
transformers' float32 ones as transformers' own bfloat16).
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.attention.paged import PagedAttentionMetadata
from engine.executor.inputs import BatchInputs
from engine.executor.kv_cache import KVCache
from engine.executor.models.decoder_only import DecoderOnlyLM, WeightSlots
from engine.executor.models.layers import (
    GatedMLP,
    GeluTanhAndMul,
    RMSNorm,
    RotaryEmbedding,
    RotaryInputs,
)
from engine.executor.models.llama import (
    Attention,
    DecoderTable,
    LayerModules,
    attention_slots,
    mlp_slots,
)
from engine.model_config import ModelConfig


class GemmaDecoderLayer(nn.Module):
    """One layer: attention and MLP, each between a norm before and a norm after ("sandwich" norms)."""

    def __init__(
        self, config: ModelConfig, layer_index: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        norm = (hidden, config.rms_norm_eps, dtype, device, config.norms_scale_in_float32)  # float32 weights
        self.window = config.layer_window(layer_index)  # None: a global layer
        self.input_layernorm = RMSNorm(*norm)
        self.self_attn = Attention(config, layer_index, dtype, device)
        self.post_attention_layernorm = RMSNorm(*norm)
        self.pre_feedforward_layernorm = RMSNorm(*norm)
        self.mlp = GatedMLP(hidden, config.intermediate_size, dtype, device, GeluTanhAndMul())
        self.post_feedforward_layernorm = RMSNorm(*norm)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the previous layer's normed MLP output (embeddings at layer 0)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: h before it (None at layer 0)
        rotary: RotaryEmbedding,
        rotation: RotaryInputs,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: PagedAttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's normed MLP output, h before it), as the Llama layer does; ``rows`` too."""
        if residual is None:
            normed, h = self.input_layernorm(x), x
        else:
            normed, h = self.input_layernorm.add_and_norm(x, residual)  # h = residual + x
        attn = self.self_attn(normed, rotary, rotation, k_cache, v_cache, meta)
        if rows is not None:
            attn, h = attn[rows], h[rows]
        # h = h + post_attn_norm(attn), then its pre-feedforward norm, in one step
        normed, h = self.pre_feedforward_layernorm.add_and_norm(self.post_attention_layernorm(attn), h)
        return self.post_feedforward_layernorm(self.mlp(normed)), h


class GemmaForCausalLM(DecoderOnlyLM):
    """``forward(inputs, kv_cache) -> logits [num_logits, vocab]`` (fp32) over one ragged batch."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(config, dtype, device, GemmaDecoderLayer)
        # NOTE: transformers multiplies by sqrt(hidden_size) rounded to the model's dtype; so does this
        self.embed_scale: torch.Tensor
        scale = torch.tensor(math.sqrt(config.hidden_size), dtype=dtype, device=self.device)
        self.register_buffer("embed_scale", scale, persistent=False)
        # Gemma 3's local layers: their own base, no scaling (None: Gemma 2's rotate as the global ones)
        self.local_rotary: RotaryEmbedding | None = None
        if config.local_rope_theta is not None:
            rotary = (config.head_dim, config.max_position_embeddings)
            self.local_rotary = RotaryEmbedding(*rotary, config.local_rope_theta, None, dtype, self.device)

    def scale_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.embed_scale

    def transform_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcapping  # Gemma 2's
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.inference_mode()
    def forward(
        self, inputs: BatchInputs, kv_cache: KVCache, decode_kernel: DecodeKernel | None = None
    ) -> torch.Tensor:
        """As ``LlamaForCausalLM.forward``: the batch's new tokens' K/V written, fp32 logits
        ``[len(inputs.logits_indices), vocab_size]`` returned for the ``logits_indices`` rows."""
        rows = inputs.logits_indices
        layers = [cast(GemmaDecoderLayer, layer) for layer in self.model.layers]
        metas = {
            window: PagedAttentionMetadata.build(
                inputs, self.config.num_queries_per_kv, self.dtype, window, decode_kernel
            )
            for window in {layer.window for layer in layers}
        }
        global_rotation = self.rotary.prepare(inputs.positions)
        local_rotation = None if self.local_rotary is None else self.local_rotary.prepare(inputs.positions)
        x = self.embed(inputs.input_ids)  # [num_tokens, hidden]
        residual: torch.Tensor | None = None
        # past the last layer's attention only the logits rows matter (as in the Llama code)
        pruned = rows.shape[0] < inputs.input_ids.shape[0] and len(layers) > 0
        for i, layer in enumerate(layers):
            rotary, rotation = self.rotary, global_rotation
            if layer.window is not None and self.local_rotary is not None and local_rotation is not None:
                rotary, rotation = self.local_rotary, local_rotation
            x, residual = layer(
                x, residual, rotary, rotation, kv_cache.k_caches[i], kv_cache.v_caches[i], metas[layer.window],
                rows if pruned and i == len(layers) - 1 else None,
            )  # fmt: skip
        h = self.final_norm(x, residual, rows, pruned)  # [num_logits, hidden]
        return self.compute_logits(h)  # [num_logits, vocab]

    def decoder_table(self) -> DecoderTable:
        """The decoder's modules, flat (see ``llama.DecoderTable``): the pre-feedforward norm as the norm
        before the MLP, the norms of the attention's and the MLP's outputs beside, the local layers' rotary
        embedding (Gemma 3's)."""
        layers = []
        for module in self.model.layers:
            layer = cast(GemmaDecoderLayer, module)
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(
                LayerModules(
                    layer.input_layernorm, attn.qkv_proj, attn.o_proj, layer.pre_feedforward_layernorm,
                    mlp.gate_up_proj, mlp.act_fn, mlp.down_proj, attn.rotates, layer.window,
                    layer.post_attention_layernorm, layer.post_feedforward_layernorm, attn.q_norm, attn.k_norm,
                    self.local_rotary if layer.window is not None else None,
                )
            )  # fmt: skip
        return DecoderTable(tuple(layers), self.model.norm, self.rotary)

    # DoLa's layer taps are the Llama code's only (``dola_layers`` is a 400 here)
    supports_early_exits = False

    # ------------------------------------------------------------------ weights
    def layer_slots(self, prefix: str, module: nn.Module) -> WeightSlots:
        """q/k/v and gate/up into their fused matrices, o/down, q/k norms (Gemma 3's), the four norms."""
        layer = cast(GemmaDecoderLayer, module)
        slots = attention_slots(prefix, layer.self_attn, fused=False) | mlp_slots(
            prefix, layer.mlp, fused=False
        )
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            weight = getattr(layer, f"{norm}_layernorm").weight
            slots[f"{prefix}{norm}_layernorm.weight"] = (weight, 0, weight.shape[0])
        return slots

    def fold_into_weights(self) -> None:
        """Gemma's RMSNorms scale by ``1 + weight`` (checkpoints store the offset from 1): the 1 is added
        here, once, in float32 (the norms' weights' dtype), so the norms are plain RMSNorms (and the fused
        ops take them)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(1.0)
