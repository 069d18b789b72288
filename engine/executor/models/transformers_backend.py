"""The transformers backend: any decoder-only ``*ForCausalLM`` of the installed transformers, run by its own
modeling code with cbserve's paged attention plugged in (engine/executor/models/transformers_attention.py),
as vLLM's Transformers backend does.

    logits = hf_model(input_ids=[1, num_tokens], position_ids=[1, num_tokens],   # the step, packed
                      logits_to_keep=logits_indices, cbserve=PagedStep(...)).logits[0]

Every architecture quirk (embedding scales, QK norms, partial rotary, logit soft-capping of the head, MoE
routing, biases) is transformers' code; cbserve owns the attention over its pages (soft-capped attention
scores included: the paged attention computes them, engine/executor/attention/paged.py). ``wrap`` runs the model
once on a few tokens first (with an ``AttentionProbe``) to learn its attention layers, and refuses at start what the
paged kernels cannot compute: attention outside transformers' attention interface, a mask of the model's
own (ALiBi, chunked attention), attention sinks, non-causal attention, layers of different head sizes, KV
head counts or soft caps, non-attention layers (state-space, linear attention).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.errors import UnsupportedModelError
from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.inputs import BatchInputs
from engine.executor.kv_cache import KVCache
from engine.executor.models.transformers_attention import AttentionCall, AttentionProbe, PagedStep, attending
from engine.executor.models.transformers_config import TransformersModelConfig, text_fields

PROBE_TOKENS = 3
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


class TransformersForCausalLM(nn.Module):
    """``forward(inputs, kv_cache, decode_kernel) -> logits [num_logits, vocab]`` (fp32) over one ragged
    batch, as the native ``LlamaForCausalLM``; the model inside is transformers' own."""

    # NOTE: CUDA graphs capture the native decode step only; transformers' forward runs eagerly.
    supports_cuda_graphs = False

    def __init__(
        self, hf_model: nn.Module, config: TransformersModelConfig, kv_layers: dict[int, int]
    ) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.config = config
        self.kv_layers = kv_layers
        param = next(hf_model.parameters())
        self.dtype: torch.dtype = param.dtype
        self.device: torch.device = param.device

    @classmethod
    def wrap(cls, hf_model: nn.Module, model: str) -> TransformersForCausalLM:
        """``hf_model`` (weights loaded, ``attn_implementation="cbserve_paged"``) ready to serve, or
        ``UnsupportedModelError`` naming ``model`` and what the paged attention cannot run."""
        hf_model.eval()
        hf_config: Any = hf_model.config
        text = hf_config.get_text_config()
        for layer_type in getattr(text, "layer_types", None) or ():
            if layer_type not in ATTENTION_LAYER_TYPES:
                raise UnsupportedModelError(
                    model, f"it has {layer_type!r} layers; cbserve runs only attention"
                )
        calls = probe_attention(hf_model)
        first = _check_layout(calls, int(text.num_hidden_layers), model)
        kv_layers = {call.layer_idx: i for i, call in enumerate(calls) if call.layer_idx is not None}
        config = TransformersModelConfig(
            architecture=type(hf_model).__name__,
            num_hidden_layers=len(calls),
            num_attention_heads=first.num_heads,
            num_key_value_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            sliding_windows=tuple(call.sliding_window for call in calls),
            attn_logit_softcapping=first.softcap,
            **text_fields(hf_config, model),
        )
        return cls(hf_model, config, kv_layers)

    @torch.inference_mode()
    def forward(
        self, inputs: BatchInputs, kv_cache: KVCache, decode_kernel: DecodeKernel | None = None
    ) -> torch.Tensor:
        """Compute the batch's new tokens, writing every layer's K/V into ``inputs.slot_mapping`` slots, and
        return fp32 logits ``[len(inputs.logits_indices), vocab_size]`` for the ``logits_indices`` rows."""
        step = PagedStep(inputs, kv_cache, decode_kernel, self.config.num_queries_per_kv, self.kv_layers)
        with attending(step):
            out = self.hf_model(
                input_ids=inputs.input_ids[None],  # [1, num_tokens]
                position_ids=inputs.positions[None],  # [1, num_tokens]
                use_cache=False,
                logits_to_keep=inputs.logits_indices,
                cbserve=step,
            )
        return out.logits[0].float()  # [num_logits, vocab]


def probe_attention(hf_model: nn.Module) -> list[AttentionCall]:
    """Every attention call of one forward over ``PROBE_TOKENS`` tokens, in call order."""
    param = next(hf_model.parameters())
    hf_config: Any = hf_model.config
    vocab = int(hf_config.get_text_config().vocab_size)
    positions = torch.arange(PROBE_TOKENS, device=param.device)[None]  # [1, PROBE_TOKENS]
    probe = AttentionProbe()
    with torch.inference_mode(), attending(probe):
        hf_model(
            input_ids=positions % vocab,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=1,
            cbserve=probe,
        )
    return probe.calls


def _check_layout(calls: list[AttentionCall], num_layers: int, model: str) -> AttentionCall:
    """The first call, once every call is one the paged attention computes exactly, each layer once, all
    with the same heads (the KV cache holds one head shape); else ``UnsupportedModelError``."""
    if not calls:
        raise UnsupportedModelError(
            model, "its attention does not go through transformers' AttentionInterface, so cbserve's paged "
            "attention cannot be plugged in",
        )  # fmt: skip
    for call in calls:
        reason = _unsupported(call)
        if reason is not None:
            raise UnsupportedModelError(model, f"{call.module} of layer {call.layer_idx}: {reason}")
    indices = [call.layer_idx for call in calls]
    if len(set(indices)) != len(indices):
        raise UnsupportedModelError(model, "a layer's attention runs more than once per forward (shared KV?)")
    if len(calls) != num_layers:
        raise UnsupportedModelError(
            model,
            f"only {len(calls)} of its {num_layers} layers are attention layers; cbserve runs only attention",
        )
    if len({c.softcap for c in calls}) > 1:
        raise UnsupportedModelError(model, "its layers soft-cap attention scores differently")
    shapes = {(c.num_heads, c.num_kv_heads, c.head_dim) for c in calls}
    if len(shapes) > 1:
        raise UnsupportedModelError(
            model, f"its layers have different (heads, KV heads, head_dim): {sorted(shapes)}; cbserve's KV cache "
            "holds one head shape for every layer",
        )  # fmt: skip
    return calls[0]


def _unsupported(call: AttentionCall) -> str | None:
    """Why the paged attention cannot compute ``call`` exactly, or None."""
    if call.layer_idx is None:
        return "the attention module has no layer_idx"
    if not call.is_causal:
        return "the attention is not causal"
    if call.has_mask:
        return "the model builds an attention mask of its own (ALiBi, chunked or custom), which the paged kernels cannot apply"
    if call.has_sinks:
        return "attention sinks are not computed by the paged attention kernels"
    if call.value_head_dim != call.head_dim:
        return f"values of {call.value_head_dim} dims for keys of {call.head_dim}; the KV cache holds one head_dim"
    if call.num_heads % call.num_kv_heads:
        return f"{call.num_heads} query heads are not a multiple of {call.num_kv_heads} KV heads"
    return None
