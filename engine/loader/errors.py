"""Errors raised while finding, reading and checking a model's files.

Every message names the file (or model) at fault and what is wrong with it, so a user who typed a bad
``--model`` sees what to fix without reading a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.errors import EngineError


class ModelLoadError(EngineError):
    """A model's files are missing, truncated, corrupt or inconsistent."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model named by the user does not exist (no such path, or the default package is missing)."""


class UnsupportedArchitectureError(ModelLoadError, ValueError):
    """The model's architecture is not one cbserve implements."""

    def __init__(self, architecture: str, supported: Iterable[str], where: str | None = None) -> None:
        self.architecture = architecture
        self.supported = tuple(supported)
        place = f" in {where}" if where else ""
        super().__init__(
            f"Unsupported model architecture {architecture!r}{place}. "
            f"Supported architectures: {', '.join(self.supported)}."
        )


class TokenizerMismatchError(ModelLoadError, ValueError):
    """The tokenizer can produce token ids the model has no embedding for."""

    def __init__(self, tokenizer_vocab_size: int, model_vocab_size: int, where: str) -> None:
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.model_vocab_size = model_vocab_size
        super().__init__(
            f"The tokenizer of {where} has {tokenizer_vocab_size} tokens but the model's vocab_size is "
            f"{model_vocab_size}: token ids >= {model_vocab_size} would index past the embedding table. "
            f"Use the tokenizer that belongs to this model."
        )
