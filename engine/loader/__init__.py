"""Model weight loaders. Every loader yields ``(hf_name, tensor)`` pairs in Hugging Face parameter names and
layout, whatever the file format:

- ``engine.loader.source`` — ``resolve_model(model, load_format)``: what ``--model`` points at;
- ``engine.loader.hf`` — a Hugging Face folder (``config.json`` + ``*.safetensors``);
- ``engine.loader.gguf`` — a llama.cpp GGUF file (dequantized, llama q/k un-permuted);
- ``engine.loader.dummy`` — random weights for a config or a preset (benchmarks without downloads);
- ``engine.loader.errors`` — the errors they raise.

NOTE: this package re-exports only the errors: the loaders import ``engine.config``, which imports the
errors from here, so importing the loaders in this ``__init__`` would be circular.
"""

from engine.loader.errors import (
    ModelLoadError,
    ModelNotFoundError,
    TokenizerMismatchError,
    UnsupportedArchitectureError,
)

__all__ = ["ModelLoadError", "ModelNotFoundError", "TokenizerMismatchError", "UnsupportedArchitectureError"]
