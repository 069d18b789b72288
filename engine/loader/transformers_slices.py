"""One rank's shard of a checkpoint for the transformers backend: a rank never holds a whole weight that its
model's tensor-parallel plan cuts, so N ranks together hold one model, not N.

The model is built on the meta device (no memory). Each parameter is then filled with exactly the part that
the plan gives the rank (``part_of``, engine/executor/parallel/transformers_plan.py: a colwise module's
rows, a rowwise one's input columns, an embedding's vocabulary rows, a replicated one whole):

- from a safetensors folder (``load_rank_slices``), read from the memory-mapped file with
  ``safe_open(...).get_slice(name)[rows]`` or ``[:, columns]``: no whole planned weight is ever read; a
  multi-file checkpoint through its ``model.safetensors.index.json`` (engine/loader/hf.py);
- from whole tensors that come one at a time (``cut_rank_tensors``: a GGUF's, dequantized), each cut as it
  comes: one whole tensor at a time, never the whole model.

Tied parameters (a head tied to the embedding) take one checkpoint tensor and share what they read where
their parts agree. Buffers the checkpoint does not hold (rotary ``inv_freq``, an embedding scale) are then
computed as transformers' ``from_pretrained`` computes them: ``initialize_weights`` over the model, which
passes over what was loaded. A missing, unexpected or mis-shaped tensor is an error, never a random
initialisation.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engine.errors import ModelLoadError
from engine.executor.parallel.transformers_plan import Part, part_of, planned_modules
from engine.loader.hf import safetensors_files
from engine.loader.transformers_weights import meta_model


@dataclass(frozen=True)
class _Stored:
    """One checkpoint tensor, not read yet: ``read(part)`` reads the part (None: the whole tensor)."""

    name: str
    shape: tuple[int, ...]
    read: Callable[[Part | None], torch.Tensor]


def load_rank_slices(
    folder: Path,
    raw: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
    world_size: int,
    model: str,
) -> tuple[nn.Module, dict[str, str]]:
    """Rank ``rank`` of ``world_size``'s model of ``folder`` (config ``raw``), its planned modules holding
    their parts and not yet hooked (``hook_plan``), and the planned modules (``planned_modules``)."""
    with ExitStack() as stack:
        return _load(_stored_in(folder, stack), raw, dtype, device, rank, world_size, model)


def cut_rank_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
    raw: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
    world_size: int,
    model: str,
) -> tuple[nn.Module, dict[str, str]]:
    """As ``load_rank_slices``, from whole tensors in Hugging Face names (a GGUF's, dequantized one at a time),
    each cut to the rank's parts as it comes: the rank holds one whole tensor at a time, never the model."""

    def stored(name: str, tensor: torch.Tensor) -> _Stored:
        return _Stored(
            name, tuple(tensor.shape), lambda part: tensor if part is None else part.take(tensor).clone()
        )

    return _load((stored(n, t) for n, t in weights), raw, dtype, device, rank, world_size, model)


def _load(
    stored: Iterable[_Stored],
    raw: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
    world_size: int,
    model: str,
) -> tuple[nn.Module, dict[str, str]]:
    net = meta_model(raw, model, dtype)
    modules = planned_modules(net, world_size, model)
    with torch.no_grad():
        _fill(net, modules, stored, rank, world_size, device, model)
    initialized: Any = net
    initialized.initialize_weights()  # NOTE: the buffers left empty; every loaded tensor is marked done
    return net, modules


def _stored_in(folder: Path, stack: ExitStack) -> Iterator[_Stored]:
    """Every tensor of the folder's safetensors files (the index's, where it has one), read lazily."""
    seen: set[str] = set()
    for path in safetensors_files(folder):
        try:
            handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        except Exception as e:  # NOTE: SafetensorError is not exported as a stable class; OSError too.
            raise ModelLoadError(f"safetensors file {path} is truncated or corrupt: {e}") from e
        for name in handle.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
            if name in seen:
                raise ModelLoadError(f"{path}: tensor {name!r} appears in more than one shard")
            seen.add(name)
            yield _Stored(name, tuple(handle.get_slice(name).get_shape()), _reader(handle, name))


def _reader(handle: Any, name: str) -> Callable[[Part | None], torch.Tensor]:
    def read(part: Part | None) -> torch.Tensor:
        return handle.get_tensor(name) if part is None else part.take(handle.get_slice(name))

    return read


def _fill(
    net: nn.Module,
    modules: dict[str, str],
    stored: Iterable[_Stored],
    rank: int,
    world_size: int,
    device: torch.device,
    model: str,
) -> None:
    """Put the rank's part of each parameter in its place, and the buffers ``stored`` holds; the other
    buffers made empty on ``device``, for ``initialize_weights`` to compute. ``ModelLoadError`` naming the
    tensors that do not fit the model."""
    params = dict(net.named_parameters(remove_duplicate=False))
    buffers = dict(net.named_buffers())
    tied = _tied_names(net)
    filled: set[str] = (
        set()
    )  # NOTE: a tied group (by its first name) takes the first of its tensors that comes
    unexpected: list[str] = []
    ignored = [re.compile(p) for p in getattr(net, "_keys_to_ignore_on_load_unexpected", None) or ()]
    ignored.append(re.compile(r"rotary_emb\.inv_freq"))  # NOTE: as transformers: old checkpoints carry them
    for item in stored:
        if item.name in params:
            names = tied[id(params[item.name])]
            if names[0] not in filled:
                _check_shape(item, params[item.name], model)
                _place(net, modules, names, item, rank, world_size, device)
                filled.add(names[0])
        elif item.name in buffers:
            _check_shape(item, buffers[item.name], model)
            value = item.read(None).to(device=device, dtype=buffers[item.name].dtype)
            value._is_hf_initialized = True  # type: ignore[attr-defined]
            _set_buffer(net, item.name, value)
        elif not any(pattern.search(item.name) for pattern in ignored):
            unexpected.append(item.name)
    missing = [names[0] for names in tied.values() if names[0] not in filled]
    problems = [
        f"{what}: {', '.join(sorted(names)[:5])}{' ...' if len(names) > 5 else ''}"
        for what, names in (("missing tensors", missing), ("unexpected tensors", unexpected))
        if names
    ]
    if problems:
        raise ModelLoadError(f"{model}: the weights do not fit config.json ({'; '.join(problems)})")
    for name, buffer in net.named_buffers():
        if buffer.is_meta:
            _set_buffer(net, name, torch.empty_like(buffer, device=device))


def _tied_names(net: nn.Module) -> dict[int, list[str]]:
    """Each parameter (by identity) -> its names: several where weights are tied."""
    names: dict[int, list[str]] = {}
    for name, param in net.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def _check_shape(item: _Stored, place: torch.Tensor, model: str) -> None:
    if item.shape != tuple(place.shape):
        raise ModelLoadError(
            f"{model}: the weights do not fit config.json (tensor {item.name!r} has shape {item.shape}, "
            f"the config needs {tuple(place.shape)})"
        )


def _place(
    net: nn.Module,
    modules: dict[str, str],
    names: list[str],
    item: _Stored,
    rank: int,
    world_size: int,
    device: torch.device,
) -> None:
    """The rank's part of ``item`` in the places ``names`` (a parameter and those tied to it); places whose
    parts agree share one tensor, read once."""
    read: dict[Part | None, nn.Parameter] = {}
    for name in names:
        module_name, _, attr = name.rpartition(".")
        part = part_of(modules.get(module_name), attr, torch.Size(item.shape), rank, world_size)
        if part not in read:
            value = item.read(part).to(device=device, dtype=net.get_parameter(name).dtype)
            read[part] = nn.Parameter(value, requires_grad=False)
            read[part]._is_hf_initialized = True  # type: ignore[attr-defined]  # NOTE: initialize_weights skips it
        net.get_submodule(module_name).register_parameter(attr, read[part])


def _set_buffer(net: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    net.get_submodule(module_name)._buffers[attr] = value  # NOTE: in place: a non-persistent buffer stays so
