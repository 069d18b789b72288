"""What the native decoder-only models share around their layers (the Llama family's llama.py, Gemma's
gemma.py):

    x = embed(ids)                                  the embedding table's rows, then the model's scale
    ... the model's layers over x ...
    logits = lm_head(norm(h[logits_indices]))       then the model's own transform of the logits

with the head's weight the embedding table itself when the checkpoint ties them, and the weights table: HF
tensor name -> (our parameter, first row, end row), the embedding, final norm and head rows here, each
layer's rows from the model (``layer_slots``), filled by ``copy_weights``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.executor.models.layers import Linear, RMSNorm, RotaryEmbedding, empty_param
from engine.model_config import ModelConfig

WeightSlots = dict[str, tuple[torch.Tensor, int, int]]  # HF tensor name -> (parameter, first row, end row)
LayerClass = Callable[[ModelConfig, int, torch.dtype, torch.device], nn.Module]


class WeightMismatchError(ModelLoadError, ValueError):
    """The checkpoint's tensors do not match the model: one is missing, unexpected or mis-shaped."""


class DecoderStack(nn.Module):
    """The decoder stack without the output head (named as in HF checkpoints: ``model.*``)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device, layer: LayerClass
    ) -> None:
        super().__init__()
        self.embed_tokens = empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(layer(config, i, dtype, device) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, device, config.norms_scale_in_float32
        )


class DecoderOnlyLM(nn.Module):
    """A ``DecoderStack`` of ``layer`` modules, its output head and its rotary embedding. Subclasses write
    the forward over the layers and say how their layers' tensors are named (``layer_slots``); where the
    model scales its embeddings, transforms its logits or folds a constant into its loaded weights, they
    override ``scale_embeddings``, ``transform_logits``, ``fold_into_weights`` (each nothing here)."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, layer: LayerClass
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.device = device
        self.model = DecoderStack(config, dtype, device, layer)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype, device, weight=tied)
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dtype,
            device,
        )

    # ------------------------------------------------------------------ in and out
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.scale_embeddings(F.embedding(input_ids, self.model.embed_tokens))  # [num_tokens, hidden]

    def scale_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def final_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor, pruned: bool
    ) -> torch.Tensor:
        """h = x + residual after the last layer, at the logits ``rows`` (already these rows only when the
        last layer ``pruned`` the others; ``residual`` is None with no layers), through the final norm."""
        if not pruned:
            x, residual = x[rows], None if residual is None else residual[rows]
        if residual is None:  # no layers
            return self.model.norm(x)  # [num_logits, hidden]
        h, _ = self.model.norm.add_and_norm(x, residual)  # [num_logits, hidden]
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        # NOTE: a head that writes its outputs as float32 itself (the AMX kernel over a GGUF's blocks:
        # engine/executor/kernels/modules.py) saves the pass that widens them
        forward_float = getattr(self.lm_head, "forward_float", None)
        logits = forward_float(h) if forward_float is not None else self.lm_head(h).float()
        return self.transform_logits(logits)  # [num_logits, vocab]

    def transform_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    # ------------------------------------------------------------------ weights
    def weight_slots(self) -> WeightSlots:
        """HF tensor name -> (our parameter, first row, end row) it fills. Raises ``RuntimeError`` once the
        fast paths replaced the dense projections (their weights are gone)."""
        slots: WeightSlots = {}
        for name, param in (
            ("model.embed_tokens.weight", self.model.embed_tokens),
            ("model.norm.weight", self.model.norm.weight),
        ):
            slots[name] = (param, 0, param.shape[0])
        if not self.config.tie_word_embeddings:
            head = dense(self.lm_head).weight
            slots["lm_head.weight"] = (head, 0, head.shape[0])
        for i, layer in enumerate(self.model.layers):
            slots.update(self.layer_slots(f"model.layers.{i}.", layer))
        return slots

    def layer_slots(self, prefix: str, layer: nn.Module) -> WeightSlots:
        """One layer's rows of the weights table, its tensors named under ``prefix`` ("model.layers.{i}.")."""
        raise NotImplementedError

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model (converting to its dtype and device), filling the fused
        qkv / gate_up matrices from their parts, then ``fold_into_weights``. Raises ``WeightMismatchError``
        naming the tensor on a missing, unexpected, duplicated or mis-shaped one; ``RuntimeError`` once the
        fast paths replaced the projections (engine/executor/fast_paths.py). Rotary ``inv_freq`` buffers
        are ignored (rebuilt from the config), as is ``lm_head.weight`` when the embeddings are tied."""
        tied = self.model.embed_tokens if self.config.tie_word_embeddings else None
        copy_weights(self.weight_slots(), weights, self.config, tied)
        self.fold_into_weights()

    def fold_into_weights(self) -> None:
        """What the model adds to its loaded weights once, so that its layers' code stays plain."""


def copy_weights(
    slots: WeightSlots,
    weights: Iterable[tuple[str, torch.Tensor]],
    config: ModelConfig,
    tied_embedding: torch.Tensor | None,
) -> None:
    """Copy HF-named ``weights`` into their ``slots`` (converting dtype and device). Raises
    ``WeightMismatchError`` naming the tensor on a missing, unexpected, duplicated or mis-shaped one. Rotary
    ``inv_freq`` buffers are skipped, as is ``lm_head.weight`` when the head reads ``tied_embedding``."""
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and tied_embedding is not None:
            expected = tuple(tied_embedding.shape)
            if tuple(tensor.shape) != expected:
                raise WeightMismatchError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}"
                )
            continue
        if name not in slots:
            raise WeightMismatchError(
                f"unexpected tensor {name!r} for a {config.architecture} model with "
                f"{config.num_hidden_layers} layers"
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


def dense(module: nn.Module) -> Linear:
    """``module`` as the dense ``Linear`` it was built as; ``RuntimeError`` where a fast path replaced it."""
    if not isinstance(module, Linear):
        raise RuntimeError(
            "load_weights after the fast paths replaced the projections: the dense weights are gone"
        )
    return module
