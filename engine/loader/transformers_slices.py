"""One rank's shard of a safetensors checkpoint for the transformers backend, read slice by slice: a rank never
holds a whole weight that its model's tensor-parallel plan cuts, so N ranks together hold one model, not N.

The model is built on the meta device (no memory). Each parameter is then filled with exactly the part that
the plan gives the rank (``part_of``, engine/executor/parallel/transformers_plan.py: a colwise module's
rows, a rowwise one's input columns, an embedding's vocabulary rows, a replicated one whole), read from the
memory-mapped file with ``safe_open(...).get_slice(name)[rows]`` or ``[:, columns]``. A multi-file
checkpoint is read through its ``model.safetensors.index.json`` (engine/loader/hf.py). Tied parameters (a
head tied to the embedding) read their checkpoint tensor once per part, and share it where the parts agree.
Buffers the checkpoint does not hold (rotary ``inv_freq``, an embedding scale) are then computed as
transformers' ``from_pretrained`` computes them: ``initialize_weights`` over the model, which passes over
what was loaded. A missing, unexpected or mis-shaped tensor is an error, never a random initialisation.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engine.errors import ModelLoadError
from engine.executor.parallel.transformers_plan import part_of, planned_modules
from engine.loader.hf import safetensors_files
from engine.loader.transformers_weights import meta_model


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
    net = meta_model(raw, model, dtype)
    modules = planned_modules(net, world_size, model)
    with ExitStack() as stack:
        files = _open(folder, stack)
        _check_names(net, files, folder)
        with torch.no_grad():
            _fill_parameters(net, modules, files, rank, world_size, device, folder)
            _fill_buffers(net, files, device)
    initialized: Any = net
    initialized.initialize_weights()  # NOTE: the buffers left empty; every loaded tensor is marked done
    return net, modules


def _open(folder: Path, stack: ExitStack) -> dict[str, Any]:
    """Every checkpoint tensor's name -> its open file."""
    files: dict[str, Any] = {}
    for path in safetensors_files(folder):
        try:
            handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        except Exception as e:  # NOTE: SafetensorError is not exported as a stable class; OSError too.
            raise ModelLoadError(f"safetensors file {path} is truncated or corrupt: {e}") from e
        for name in handle.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
            if name in files:
                raise ModelLoadError(f"{path}: tensor {name!r} appears in more than one shard")
            files[name] = handle
    return files


def _check_names(net: nn.Module, files: dict[str, Any], folder: Path) -> None:
    """``ModelLoadError`` naming the checkpoint tensors the model has no place for, and the parameters the
    checkpoint has no tensor for (a tied parameter needs one of its names)."""
    places = {name for name, _ in net.named_parameters(remove_duplicate=False)}
    places |= {name for name, _ in net.named_buffers()}
    ignored = [re.compile(p) for p in getattr(net, "_keys_to_ignore_on_load_unexpected", None) or ()]
    ignored.append(re.compile(r"rotary_emb\.inv_freq"))  # NOTE: as transformers: old checkpoints carry them
    unexpected = [n for n in files if n not in places and not any(p.search(n) for p in ignored)]
    missing = [names[0] for names in _tied_names(net).values() if not any(n in files for n in names)]
    problems = [
        f"{what}: {', '.join(sorted(names)[:5])}{' ...' if len(names) > 5 else ''}"
        for what, names in (("missing tensors", missing), ("unexpected tensors", unexpected))
        if names
    ]
    if problems:
        raise ModelLoadError(f"{folder}: the weights do not fit config.json ({'; '.join(problems)})")


def _tied_names(net: nn.Module) -> dict[int, list[str]]:
    """Each parameter (by identity) -> its names: several where weights are tied."""
    names: dict[int, list[str]] = {}
    for name, param in net.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def _fill_parameters(
    net: nn.Module,
    modules: dict[str, str],
    files: dict[str, Any],
    rank: int,
    world_size: int,
    device: torch.device,
    folder: Path,
) -> None:
    """Put the rank's part of each parameter in its place, read from ``files``."""
    tied = _tied_names(net)
    read: dict[tuple[str, Any], nn.Parameter] = {}  # (checkpoint tensor, part) -> the parameter made of it
    for name, param in list(net.named_parameters(remove_duplicate=False)):
        source = name if name in files else next(n for n in tied[id(param)] if n in files)
        stored = tuple(files[source].get_slice(source).get_shape())
        if stored != tuple(param.shape):
            raise ModelLoadError(
                f"{folder}: the weights do not fit config.json (tensor {source!r} has shape {stored}, "
                f"the config needs {tuple(param.shape)})"
            )
        module_name, _, attr = name.rpartition(".")
        part = part_of(modules.get(module_name), attr, param.shape, rank, world_size)
        if (source, part) not in read:
            whole = files[source]
            value = whole.get_tensor(source) if part is None else part.take(whole.get_slice(source))
            loaded = nn.Parameter(value.to(device=device, dtype=param.dtype), requires_grad=False)
            loaded._is_hf_initialized = True  # type: ignore[attr-defined]  # NOTE: initialize_weights skips it
            read[source, part] = loaded
        net.get_submodule(module_name).register_parameter(attr, read[source, part])


def _fill_buffers(net: nn.Module, files: dict[str, Any], device: torch.device) -> None:
    """The buffers the checkpoint holds, read whole; the others made empty on ``device``, for
    ``initialize_weights`` to compute."""
    for name, buffer in list(net.named_buffers()):
        module_name, _, attr = name.rpartition(".")
        module = net.get_submodule(module_name)
        if name in files:
            value = files[name].get_tensor(name).to(device=device, dtype=buffer.dtype)
            value._is_hf_initialized = True  # type: ignore[attr-defined]
        else:
            value = torch.empty_like(buffer, device=device)
        module._buffers[attr] = value  # NOTE: in place, so that a non-persistent buffer stays so
