"""A rank of the transformers backend reads only its parts of a safetensors checkpoint
(engine/loader/transformers_slices.py), in this process (no ranks spawned): what it holds equals the whole
model cut by the plan (its buffers as transformers computes them), a planned weight is never read whole,
only through ``get_slice`` for exactly the rank's rows or columns, so the rank holds about 1/N of the planned
weights; a multi-file checkpoint reads the same through its index; a tensor that does not fit is refused.
The two-rank forward over these parts is tests/engine/test_tensor_parallel_transformers.py's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from model_harness import save_tiny
from safetensors.torch import load_file, save_file
from torch import nn

from engine.errors import ModelLoadError
from engine.executor.parallel.transformers_plan import cut_to_rank, part_of, planned_modules
from engine.loader import transformers_slices
from engine.loader.transformers_slices import cut_rank_tensors, load_rank_slices
from engine.loader.transformers_weights import from_pretrained

CPU = torch.device("cpu")
WORLD_SIZE = 2
# as tests/engine/test_tensor_parallel_transformers.py: biases everywhere (Phi); a tied embedding and head,
# 301 vocabulary rows: the last rank's padded (Gemma)
ARCHS = {"phi": "PhiConfig", "gemma": "GemmaConfig"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-slices")
    return {name: save_tiny(root / name, cls, {"vocab_size": 301}) for name, cls in ARCHS.items()}


def _raw(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def _slices(folder: Path, rank: int) -> tuple[nn.Module, dict[str, str]]:
    return load_rank_slices(folder, _raw(folder), torch.float32, CPU, rank, WORLD_SIZE, folder.name)


class _Reads:
    """What the loader reads: the tensors read whole, and each slice read with the shape it returned."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real = real
        self.whole: list[str] = []
        self.slices: list[tuple[str, tuple[int, ...]]] = []

    def open(self, *args: Any, **kwargs: Any) -> _File:
        return _File(self.real(*args, **kwargs), self)


class _File:
    def __init__(self, handle: Any, reads: _Reads) -> None:
        self.handle, self.reads = handle, reads

    def __enter__(self) -> _File:
        self.handle.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self.handle.keys())

    def get_tensor(self, name: str) -> torch.Tensor:
        self.reads.whole.append(name)
        return self.handle.get_tensor(name)  # type: ignore[no-any-return]

    def get_slice(self, name: str) -> _Slice:
        return _Slice(name, self.handle.get_slice(name), self.reads)


class _Slice:
    def __init__(self, name: str, stored: Any, reads: _Reads) -> None:
        self.name, self.stored, self.reads = name, stored, reads

    def get_shape(self) -> list[int]:
        return self.stored.get_shape()  # type: ignore[no-any-return]

    def __getitem__(self, index: Any) -> torch.Tensor:
        value: torch.Tensor = self.stored[index]
        self.reads.slices.append((self.name, tuple(value.shape)))
        return value


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("rank", range(WORLD_SIZE))
def test_a_rank_holds_the_whole_model_cut_by_its_plan(folders: dict[str, Path], arch: str, rank: int) -> None:
    folder = folders[arch]
    mine, modules = _slices(folder, rank)
    whole = from_pretrained(folder, _raw(folder), torch.float32, CPU)
    assert planned_modules(whole, WORLD_SIZE, arch) == modules
    cut_to_rank(whole, modules, rank, WORLD_SIZE)
    expected, got = whole.state_dict(), mine.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    buffers = dict(mine.named_buffers())  # rotary inv_freq, Gemma's embedding scale: not in the checkpoint
    for name, buffer in whole.named_buffers():
        assert buffers[name].device == CPU and torch.equal(buffers[name], buffer), name


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_planned_weight_is_read_only_as_the_ranks_part(
    folders: dict[str, Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = _Reads(transformers_slices.safe_open)
    monkeypatch.setattr(transformers_slices, "safe_open", reads.open)
    mine, modules = _slices(folders[arch], 1)
    stored = load_file(str(folders[arch] / "model.safetensors"))
    planned = {
        name: part_of(modules[name.rpartition(".")[0]], name.rpartition(".")[2], tensor.shape, 1, WORLD_SIZE)
        for name, tensor in stored.items()
        if name.rpartition(".")[0] in modules
    }
    sharded = {name for name, part in planned.items() if part is not None}
    assert sharded and not sharded & set(reads.whole)  # every q/k/v/o, MLP and embedding weight
    sliced = dict(reads.slices)
    assert len(sliced) == len(reads.slices)  # each part read once (Gemma's tied head: none of its own)
    for name in sharded:
        part = planned[name]
        assert part is not None
        whole_shape = tuple(stored[name].shape)
        mine_shape = (
            (part.stop - part.start, *whole_shape[1:]) if part.dim == 0 else (whole_shape[0], part.size)
        )
        assert sliced[name] == mine_shape, name
    held = {(p := mine.get_parameter(name)).data_ptr(): p.nbytes for name in sharded}  # tied: held once
    padding = stored["model.embed_tokens.weight"][0].nbytes  # the last rank's zero row: embedding, head
    assert sum(held.values()) <= sum(stored[name].nbytes for name in sharded) / WORLD_SIZE + 2 * padding


@pytest.mark.parametrize("arch", list(ARCHS))
def test_whole_tensors_that_come_one_at_a_time_are_cut_as_they_come(
    folders: dict[str, Path], arch: str
) -> None:
    folder = folders[arch]
    stream = iter(load_file(str(folder / "model.safetensors")).items())  # as a GGUF's, dequantized
    mine, modules = cut_rank_tensors(stream, _raw(folder), torch.float32, CPU, 1, WORLD_SIZE, arch)
    expected = _slices(folder, 1)[0]
    assert mine.state_dict().keys() == expected.state_dict().keys()
    for name, tensor in expected.state_dict().items():
        assert torch.equal(mine.state_dict()[name], tensor), name
    for name, param in mine.named_parameters():
        assert param.untyped_storage().nbytes() == param.nbytes, name  # no whole tensor kept alive by a view


def test_a_multi_file_checkpoint_is_read_through_its_index(folders: dict[str, Path], tmp_path: Path) -> None:
    import transformers

    folder = folders["phi"]
    whole = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    whole.save_pretrained(tmp_path, max_shard_size="40KB")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    for rank in range(WORLD_SIZE):
        expected, got = _slices(folder, rank)[0].state_dict(), _slices(tmp_path, rank)[0].state_dict()
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda t: t.pop("model.layers.1.mlp.fc2.weight"), "missing tensors: model.layers.1.mlp.fc2.weight"),
        (lambda t: t.update(extra=torch.zeros(2)), "unexpected tensors: extra"),
        (
            lambda t: t.update({"model.final_layernorm.weight": torch.zeros(63)}),
            r"tensor 'model.final_layernorm.weight' has shape \(63,\), the config needs \(64,\)",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_refused(
    folders: dict[str, Path], tmp_path: Path, change: Callable[[dict[str, torch.Tensor]], object], reason: str
) -> None:
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_text((folders["phi"] / name).read_text())
    tensors = load_file(str(folders["phi"] / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=reason):
        _slices(tmp_path, 0)
