"""Dummy weights (``load_format="dummy"``) through the Engine API: a dummy model whose embedding has more rows
than its borrowed tokenizer spells generates only ids the tokenizer can spell, so text comes out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.loader.model_loader import load_tokenizer
from engine.model_config import ModelConfig

pytestmark = pytest.mark.slow  # the default model's tokenizer, read from its GGUF

TOKENIZER_IDS = 49152  # the default model's tokenizer


@pytest.fixture(scope="module")
def wide_dummy(tmp_path_factory: pytest.TempPathFactory, tiny_model_config: ModelConfig) -> Path:
    """The tiny Llama with a 60,000-row embedding (Llama 3's is 128,256) and the default tokenizer."""
    folder = tmp_path_factory.mktemp("wide-dummy")
    config = tiny_model_config.replace(vocab_size=60000)
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    load_tokenizer("default").save(folder)
    return folder


def test_a_dummy_model_generates_only_ids_its_tokenizer_spells(wide_dummy: Path) -> None:
    engine = Engine.from_pretrained(str(wide_dummy), load_format="dummy", device="cpu", dtype="float32")
    assert engine.model_config.vocab_size == 60000 and engine.tokenizer.vocab_size == TOKENIZER_IDS
    assert engine.vocab_size == TOKENIZER_IDS
    prompts = [engine.tokenizer.encode(t) for t in ("Hello there", "1, 2, 3,", "The sea")]
    outputs = engine.generate_batch(
        prompts,
        progress_bar=False,
        max_new_tokens=48,
        do_sample=True,
        temperature=5.0,
        seed=3,
        ignore_eos=True,
    )
    generated = [t for out in outputs.values() for t in out.generated_ids]
    assert len(generated) == 3 * 48
    assert max(generated) < TOKENIZER_IDS
    assert all(out.text for out in outputs.values())
    manager = engine.init_continuous_batching()
    manager.start()
    try:
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            manager.add_request([50000], max_new_tokens=2)
    finally:
        manager.stop()
