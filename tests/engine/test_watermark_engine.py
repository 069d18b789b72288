"""Watermarking end to end through the Python API on the default model: sampled generations with a
watermark are detected and those without are not, for every scheme; a watermarked request leaves the
other requests of its batch exactly as they are alone."""

from __future__ import annotations

from typing import Any

import pytest
from default_engine import engine_on

from engine.engine import Engine
from engine.generation.config import GenerationConfigError
from engine.loader.model_loader import LoadedModel

pytestmark = pytest.mark.slow  # the real model, float32

PROMPTS = [
    "The capital of France is",
    "Write a short story about a dragon:",
    "Explain how rain forms.",
    "My favourite recipe is",
]
NUM_TOKENS = 40
WATERMARKS: list[dict[str, Any]] = [
    {"bias": 4.0},
    {"bias": 4.0, "seeding_scheme": "selfhash", "context_width": 2, "hashing_key": 7919},
    {"ngram_len": 4, "keys": list(range(100, 120))},
]


@pytest.fixture(scope="module")
def engine(default_model: LoadedModel) -> Engine:
    return engine_on(default_model, num_blocks=256)


def _generate(engine: Engine, seed: int, **options: Any) -> list[list[int]]:
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    outs = engine.generate_batch(
        prompts,
        max_new_tokens=NUM_TOKENS,
        min_new_tokens=NUM_TOKENS,
        do_sample=True,
        seed=seed,
        progress_bar=False,
        **options,
    )
    return [outs[f"batch_req_{i}"].generated_ids for i in range(len(prompts))]


@pytest.fixture(scope="module")
def plain_generations(engine: Engine) -> dict[int, list[list[int]]]:
    """The generations without a watermark, by seed: every scheme checks its detector on the same ones."""
    return {seed: _generate(engine, seed) for seed in (1, 2)}


@pytest.mark.parametrize("watermark", WATERMARKS, ids=["lefthash", "selfhash", "synthid"])
def test_watermarked_generations_are_detected_and_plain_ones_are_not(
    engine: Engine, plain_generations: dict[int, list[list[int]]], watermark: dict[str, Any]
) -> None:
    for seed, plain in plain_generations.items():
        marked = _generate(engine, seed, watermarking_config=watermark)
        assert marked != plain
        for ids in marked:
            detection = engine.detect_watermark(ids, watermark)
            assert detection.prediction, (seed, engine.tokenizer.decode(ids), detection)
        for ids in plain:
            detection = engine.detect_watermark(ids, watermark)
            assert not detection.prediction, (seed, engine.tokenizer.decode(ids), detection)


def test_detection_from_text_and_from_another_key(engine: Engine) -> None:
    watermark = WATERMARKS[0]
    [ids, *_] = _generate(engine, 3, watermarking_config=watermark)
    text = engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert engine.detect_watermark(text, watermark).prediction
    assert not engine.detect_watermark(ids, {**watermark, "hashing_key": 1234}).prediction


def _run_together(engine: Engine, requests: list[tuple[list[int], dict[str, Any]]]) -> list[list[int]]:
    """Every request admitted before the loop starts, so that they share their steps."""
    manager = engine.init_continuous_batching()
    ids = []
    manager.start()
    try:
        ids = [manager.add_request(prompt, max_new_tokens=16, **options) for prompt, options in requests]
        results: dict[str, list[int]] = {}
        while len(results) < len(ids):
            out = manager.get_result(timeout=60)
            assert out is not None
            if out.is_finished:
                results[out.request_id] = out.generated_ids
    finally:
        manager.stop(timeout=30)
    return [results[rid] for rid in ids]


def test_a_watermarked_request_leaves_its_batch_alone(engine: Engine) -> None:
    """Seeded sampled requests get the same tokens beside watermarked ones as without them."""
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    plain = [(p, {"do_sample": True, "seed": 10 + i}) for i, p in enumerate(prompts)]
    marked = [
        (p, {"do_sample": True, "seed": 20 + i, "watermarking_config": WATERMARKS[i % len(WATERMARKS)]})
        for i, p in enumerate(prompts)
    ]
    alone = _run_together(engine, plain)
    mixed = _run_together(engine, [r for pair in zip(plain, marked, strict=True) for r in pair])
    assert mixed[0::2] == alone


def test_bad_watermark_is_refused_at_admission(engine: Engine) -> None:
    prompt = engine.tokenizer.encode(PROMPTS[0])
    with pytest.raises(GenerationConfigError, match=r"^watermarking_config\.greenlist_ratio"):
        engine.generate_batch(
            [prompt], max_new_tokens=2, progress_bar=False, watermarking_config={"greenlist_ratio": 2}
        )
    with pytest.raises(GenerationConfigError, match="^watermarking_config: is required"):
        engine.detect_watermark([1, 2, 3], None)
