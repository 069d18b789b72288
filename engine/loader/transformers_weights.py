"""The transformers model of a checkpoint, weights in, ``attn_implementation="cbserve_paged"``, built one of
three ways:

- a safetensors folder: transformers' own ``from_pretrained`` in the serving dtype, straight onto the
  device (it builds on the meta device and assigns each tensor as read: no second copy; it renames and
  fuses checkpoint tensors, e.g. MoE experts, and ties embeddings); a missing, unexpected or mis-shaped
  tensor is an error, never a random initialisation;
- tensors in Hugging Face names (a GGUF's, dequantized one at a time): the model built on the device, each
  tensor copied into its parameter as it comes;
- ``load_format="dummy"``: transformers' own initialisation, seeded (random weights, real shapes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.executor.models import transformers_attention
from engine.executor.models.transformers_attention import ATTN_IMPLEMENTATION
from engine.executor.models.transformers_config import causal_lm_class, hf_config_from_dict


def build_hf_config(raw: dict[str, Any], model: str) -> tuple[Any, type[Any]]:
    """The transformers config of ``raw`` (a ``config.json`` dict) and its causal LM class."""
    hf_config = hf_config_from_dict(raw, model)
    return hf_config, causal_lm_class(hf_config, model)


@contextmanager
def _pluggable(model: str) -> Iterator[None]:
    """Building the model: a modeling file with its own table of attention classes (Falcon) has no entry
    for ``cbserve_paged`` and raises ``KeyError``; that is an ``UnsupportedModelError``."""
    try:
        yield
    except KeyError as e:
        if ATTN_IMPLEMENTATION not in str(e):
            raise
        raise UnsupportedModelError(
            model,
            "its modeling code picks attention classes of its own, so cbserve's paged attention cannot be plugged in",
        ) from e


def from_pretrained(folder: Path, raw: dict[str, Any], dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The folder's model through transformers' ``from_pretrained``; ``ModelLoadError`` naming the
    tensors that do not fit the config."""
    hf_config, cls = build_hf_config(raw, folder.name)
    transformers_attention.register()
    with _pluggable(folder.name):
        try:
            model, info = cls.from_pretrained(
                str(folder),
                config=hf_config,
                dtype=dtype,
                attn_implementation=ATTN_IMPLEMENTATION,
                device_map=str(device),
                output_loading_info=True,
                # NOTE: so that the mis-shaped tensors are listed in ``info`` (and refused below), not logged
                ignore_mismatched_sizes=True,
            )
        except (RuntimeError, ValueError, OSError) as e:
            raise ModelLoadError(f"{folder}: transformers could not load the weights: {e}") from e
    problems = [
        f"{what}: {', '.join(sorted(_describe(k) for k in keys)[:5])}{' ...' if len(keys) > 5 else ''}"
        for what, keys in (
            ("missing tensors", info.get("missing_keys")),
            ("unexpected tensors", info.get("unexpected_keys")),
            ("mis-shaped tensors", info.get("mismatched_keys")),
        )
        if keys
    ]
    if problems:
        raise ModelLoadError(f"{folder}: the weights do not fit config.json ({'; '.join(problems)})")
    return model  # type: ignore[no-any-return]


def _describe(key: Any) -> str:
    """A loading-info entry: a tensor name, or (name, checkpoint shape, model shape)."""
    if isinstance(key, tuple) and len(key) == 3:
        name, stored, expected = key
        return f"{name} {tuple(stored)} where the config needs {tuple(expected)}"
    return str(key)


def from_tensors(
    raw: dict[str, Any],
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    model: str,
) -> nn.Module:
    """The model of ``raw`` with ``weights`` (Hugging Face names) copied in one at a time."""
    hf_config, cls = build_hf_config(raw, model)
    transformers_attention.register()
    with torch.device(device), _pluggable(model):
        net = cls._from_config(hf_config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    # NOTE: named_parameters() lists a tied parameter once, under its first name (the embedding).
    slots = {**dict(net.named_parameters()), **dict(net.named_buffers())}
    tied = {name for name, _ in net.named_parameters(remove_duplicate=False)} - set(slots)
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if name in tied:
                continue
            if name not in slots:
                raise ModelLoadError(f"{model}: unexpected tensor {name!r} for {cls.__name__}")
            if tuple(tensor.shape) != tuple(slots[name].shape):
                raise ModelLoadError(
                    f"{model}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(slots[name].shape)}"
                )
            slots[name].copy_(tensor)
            loaded.add(name)
    missing = sorted(set(dict(net.named_parameters())) - loaded)
    if missing:
        raise ModelLoadError(f"{model}: missing tensors {', '.join(missing[:5])}")
    return net  # type: ignore[no-any-return]


def random_weights(
    raw: dict[str, Any], dtype: torch.dtype, device: torch.device, model: str, seed: int = 0
) -> nn.Module:
    """The model of ``raw`` with transformers' own initialisation, seeded by ``seed``."""
    hf_config, cls = build_hf_config(raw, model)
    transformers_attention.register()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device), _pluggable(model):
        torch.manual_seed(seed)
        net = cls._from_config(hf_config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    return net  # type: ignore[no-any-return]


def meta_model(raw: dict[str, Any], model: str, dtype: torch.dtype | None = None) -> nn.Module:
    """The model of ``raw`` on the meta device (in ``dtype``, else its config's): its modules, shapes and
    plans, no memory, no weight read."""
    hf_config, cls = build_hf_config(raw, model)
    transformers_attention.register()
    with torch.device("meta"), _pluggable(model):
        net = cls._from_config(hf_config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    return net  # type: ignore[no-any-return]
