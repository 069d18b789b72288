"""A Hugging Face model folder: ``config.json``, ``*.safetensors`` (one file, or shards listed in
``model.safetensors.index.json``), ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``.

Weights are read lazily with ``safetensors.safe_open`` (memory-mapped, one tensor at a time), so a large
checkpoint never needs a second full copy in host memory. ``save_hf_folder`` writes the same layout back
(used to turn the default GGUF into a folder transformers can load, and by the tests).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.errors import ModelLoadError
from engine.model_config import ModelConfig

if TYPE_CHECKING:
    from engine.loader.tokenizer import Tokenizer

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILE = "tokenizer.json"


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; a missing or malformed file raises ``ModelLoadError`` naming it."""
    if not path.is_file():
        raise ModelLoadError(f"{path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def load_hf_config(folder: str | Path) -> ModelConfig:
    path = Path(folder) / CONFIG_FILE
    return ModelConfig.from_hf_dict(read_json(path), where=str(path))


def load_generation_config(folder: str | Path) -> dict[str, Any]:
    """The model's generation defaults (``generation_config.json``), or ``{}`` when it has none."""
    path = Path(folder) / GENERATION_CONFIG_FILE
    return read_json(path) if path.is_file() else {}


def load_tokenizer_config(folder: str | Path) -> dict[str, Any]:
    """``tokenizer_config.json`` (special tokens, chat template), or ``{}`` when absent."""
    path = Path(folder) / TOKENIZER_CONFIG_FILE
    return read_json(path) if path.is_file() else {}


def safetensors_files(folder: str | Path) -> list[Path]:
    """The weight files of ``folder``: the shards named by the index when there is one, else every
    ``*.safetensors`` file. A shard the index names but the folder lacks raises ``ModelLoadError``."""
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path} has no weight_map")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index_path} lists shard(s) missing from {folder}: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weight files")
    return files


def iter_safetensors_weights(
    folder: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the folder's weight files, one at a time, optionally
    cast to ``dtype``. A truncated or corrupt file raises ``ModelLoadError`` naming it."""
    seen: set[str] = set()
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
                    if name in seen:
                        raise ModelLoadError(f"{path}: tensor {name!r} appears in more than one shard")
                    seen.add(name)
                    tensor = f.get_tensor(name)
                    yield name, tensor if dtype is None else tensor.to(dtype)
        except ModelLoadError:
            raise
        except Exception as e:  # NOTE: SafetensorError is not exported as a stable class; OSError too.
            raise ModelLoadError(f"safetensors file {path} is truncated or corrupt: {e}") from e


def save_hf_folder(
    folder: str | Path,
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    tokenizer: Tokenizer | None = None,
    generation_config: dict[str, Any] | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``config``, ``weights`` (Hugging Face names) and optionally the tokenizer and generation
    defaults as a Hugging Face folder that transformers and ``iter_safetensors_weights`` read back.

    With ``max_shard_bytes`` the weights are split into ``model-0000i-of-0000n.safetensors`` shards plus
    ``model.safetensors.index.json``. Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(config.to_hf_dict(), indent=2), encoding="utf-8")
    if generation_config is not None:
        (folder / GENERATION_CONFIG_FILE).write_text(json.dumps(generation_config, indent=2), encoding="utf-8")
    if tokenizer is not None:
        tokenizer.save(folder)

    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    total_bytes = 0
    for name, tensor in weights:
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # tied: transformers re-creates it from the embedding
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        # NOTE: safetensors refuses views sharing storage and non-contiguous tensors: store clean copies.
        shards[-1][name] = tensor.detach().to("cpu").contiguous().clone()
        shard_bytes += nbytes
        total_bytes += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata=metadata)
        return folder
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2), encoding="utf-8")
    return folder
