"""cbserve's paged attention behind transformers' attention interface: ``attn_implementation="cbserve_paged"``.

transformers' modeling code computes each layer's q/k/v (projections, QK norms, rotary, partial rotary: its
own code) and hands them to the function registered under the model's ``attn_implementation``::

    fn(module, query [1, heads, tokens, head_dim], key [1, kv_heads, tokens, head_dim], value, attention_mask,
       scaling=..., dropout=..., sliding_window=..., softcap=..., s_aux=..., **forward_kwargs)
    -> (out [1, tokens, heads, head_dim], weights or None)

``module`` is the layer's attention module (``layer_idx``, ``is_causal``, ...); ``forward_kwargs`` are the
keyword arguments the model's ``forward`` was called with, passed down through every layer, as
transformers' own continuous batching passes its paged-cache metadata. cbserve calls the model on one
packed sequence (batch 1: every token of the step, ``position_ids`` = each token's absolute position) with
``cbserve=PagedStep(...)``, inside ``attending(step)`` (a context variable: the few models whose decoder
layers drop the forward's keyword arguments, e.g. StableLM, reach it there). This function writes the
layer's new K/V into the pages
(``BatchInputs.slot_mapping``) and attends over them with the same kernels as the native model
(engine/executor/attention/paged.py). transformers builds no mask for an implementation it has no mask
function for: ``attention_mask`` is None, the batch's structure is in the step's metadata.

The same function, given an ``AttentionProbe`` instead, records each call's layout and computes
plain causal attention (no cache): how the loader learns the model's attention layers before any KV cache
exists (engine/executor/models/transformers_backend.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.executor.attention.decode_kernel import DecodeKernel
from engine.executor.attention.paged import PagedAttentionMetadata, paged_attention
from engine.executor.inputs import BatchInputs
from engine.executor.kv_cache import KVCache

ATTN_IMPLEMENTATION = "cbserve_paged"


@dataclass
class PagedStep:
    """One forward's attention context, shared by every layer: the batch, the cache, the decode kernel,
    and the paged-attention metadata per sliding window (built once per forward, on first use)."""

    inputs: BatchInputs
    kv_cache: KVCache
    decode_kernel: DecodeKernel | None
    num_queries_per_kv: int
    kv_layers: dict[int, int]  # transformers' layer_idx -> the KV cache's layer
    _metadata: dict[int | None, PagedAttentionMetadata] = field(default_factory=dict)

    def metadata(self, sliding_window: int | None) -> PagedAttentionMetadata:
        meta = self._metadata.get(sliding_window)
        if meta is None:
            meta = PagedAttentionMetadata.build(
                self.inputs, self.num_queries_per_kv, self.kv_cache.dtype, sliding_window, self.decode_kernel
            )
            self._metadata[sliding_window] = meta
        return meta


@dataclass(frozen=True)
class AttentionCall:
    """What one attention call of a probe forward showed about its layer."""

    layer_idx: int | None
    module: str  # the attention module's class
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    sliding_window: int | None
    softcap: float | None
    has_sinks: bool
    is_causal: bool
    has_mask: bool


@dataclass
class AttentionProbe:
    """Collects the ``AttentionCall`` of every attention call of one forward."""

    calls: list[AttentionCall] = field(default_factory=list)


_CURRENT: ContextVar[PagedStep | AttentionProbe | None] = ContextVar("cbserve_attention", default=None)


@contextmanager
def attending(context: PagedStep | AttentionProbe) -> Iterator[None]:
    """Within the block, attention calls that get no ``cbserve`` keyword argument use ``context``."""
    token = _CURRENT.set(context)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    value: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cbserve: PagedStep | AttentionProbe | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention of ``module``'s layer over the step's pages: ``[1, num_tokens, num_heads, head_dim]``."""
    context = cbserve if cbserve is not None else _CURRENT.get()
    if isinstance(context, AttentionProbe):
        return _probe(
            module, query, key, value, attention_mask, scaling, sliding_window, softcap, context, kwargs
        )
    if context is None:
        raise RuntimeError(f"the {ATTN_IMPLEMENTATION} attention runs only inside cbserve's forward")
    layer = context.kv_layers[_layer_idx(module)]
    cache = context.kv_cache
    k_cache, v_cache = cache.k_caches[layer], cache.v_caches[layer]
    q = query[0].transpose(0, 1).to(cache.dtype)  # [num_tokens, num_heads, head_dim]
    k, v = (
        _token_major(key, cache.dtype),
        _token_major(value, cache.dtype),
    )  # [num_tokens, num_kv_heads, head_dim]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    meta = context.metadata(sliding_window)
    out = paged_attention(
        q, k, v, k_cache, v_cache, meta, scale, softcap
    )  # [num_tokens, num_heads, head_dim]
    return out.to(query.dtype)[None], None  # [1, num_tokens, num_heads, head_dim]


def _layer_idx(module: nn.Module) -> int:
    index = module.layer_idx
    assert isinstance(index, int)  # NOTE: the probe refused modules without one at start
    return index


def _token_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[1, heads, num_tokens, head_dim]`` as a fresh ``[num_tokens, heads, head_dim]`` tensor with
    the standard strides. NOTE: ``contiguous()`` keeps a one-head tensor's odd head stride (multi-query
    attention), which the kernels' K/V writer refuses."""
    out = torch.empty(x.shape[2], x.shape[1], x.shape[3], dtype=dtype, device=x.device)
    return out.copy_(x[0].transpose(0, 1))


def _probe(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    probe: AttentionProbe,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Record the call's layout; compute plain causal attention over the call's own tokens."""
    layer_idx = getattr(module, "layer_idx", None)
    probe.calls.append(
        AttentionCall(
            layer_idx=layer_idx if isinstance(layer_idx, int) else None,
            module=type(module).__name__,
            num_heads=query.shape[1],
            num_kv_heads=key.shape[1],
            head_dim=query.shape[-1],
            value_head_dim=value.shape[-1],
            sliding_window=sliding_window,
            softcap=softcap,
            has_sinks=kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None,
            is_causal=bool(getattr(module, "is_causal", True)),
            has_mask=attention_mask is not None,
        )
    )
    out = F.scaled_dot_product_attention(
        query, key.to(query.dtype), value.to(query.dtype), is_causal=True, scale=scaling, enable_gqa=True
    )  # [1, num_heads, num_tokens, head_dim]
    return out.transpose(1, 2), None


def register() -> None:
    """Make ``attn_implementation="cbserve_paged"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
