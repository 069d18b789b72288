"""Watermarks against transformers' own classes: the processors (``WatermarkLogitsProcessor``,
``SynthIDTextWatermarkLogitsProcessor``) on random logits and tokens, alone and beside other rows; the
detector against ``WatermarkDetector`` and SynthID's reference scores; the config's validation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers import PretrainedConfig, SynthIDTextWatermarkingConfig, WatermarkingConfig
from transformers.generation.logits_process import (
    SynthIDTextWatermarkLogitsProcessor,
    WatermarkLogitsProcessor,
)
from transformers.generation.watermarking import WatermarkDetector

from engine.errors import InvalidRequestError
from engine.generation.config import GenerationConfig, GenerationConfigError
from engine.generation.processors import apply_logits_processors
from engine.generation.rows import SamplingRow
from engine.generation.watermark_config import GreenlistWatermark, SynthIDWatermark, watermarking_config_from
from engine.generation.watermark_detect import detect_watermark, synthid_mask

V = 1000
BOS = 1
EOS = 2
PROMPT_LEN = 5

GREENLIST_CASES: list[dict[str, Any]] = [
    {},  # transformers' defaults
    {"greenlist_ratio": 0.5, "bias": 1.0, "hashing_key": 7, "seeding_scheme": "lefthash", "context_width": 3},
    {"greenlist_ratio": 0.3, "bias": 2.5, "seeding_scheme": "selfhash", "context_width": 1},
    {
        "greenlist_ratio": 0.2,
        "bias": 4.0,
        "hashing_key": 99991,
        "seeding_scheme": "selfhash",
        "context_width": 4,
    },
]
SYNTHID_CASES: list[dict[str, Any]] = [
    {"ngram_len": 5, "keys": [654, 400, 836, 123, 340, 443, 597, 160, 57]},
    {"ngram_len": 3, "keys": [1, 2, 3], "context_history_size": 4, "sampling_table_size": 4096},
    {"ngram_len": 4, "keys": [11, 12], "sampling_table_seed": 5, "skip_first_ngram_calls": True},
    {"ngram_len": 2, "keys": [3, 1, 4, 1, 5], "debug_mode": True, "context_history_size": 3},
]


def _rows(config: dict[str, Any], ids: torch.Tensor, **extra: Any) -> list[SamplingRow]:
    gc = GenerationConfig(watermarking_config=config, **extra)
    return [
        SamplingRow(config=gc, prompt_ids=r[:PROMPT_LEN].tolist(), output_ids=r[PROMPT_LEN:].tolist())
        for r in ids
    ]


def _ours(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    return apply_logits_processors(logits.clone(), rows, default_eos=(EOS,))


@pytest.mark.parametrize("case", GREENLIST_CASES)
def test_greenlist_processor_equals_transformers(case: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(0)
    hf = WatermarkingConfig(**case).construct_processor(V, "cpu")
    assert isinstance(hf, WatermarkLogitsProcessor)
    for length in (PROMPT_LEN, PROMPT_LEN + 1, PROMPT_LEN + 9):
        ids = torch.randint(0, V, (4, length), generator=gen)
        logits = torch.randn((4, V), generator=gen) * 3
        expected = hf(ids, logits.clone())
        got = _ours(logits, _rows(case, ids))
        assert torch.equal(got, expected)
        assert not torch.equal(got, logits)


def test_greenlist_skips_rows_shorter_than_the_context() -> None:
    case = {"context_width": 4}
    ids = torch.tensor([[5, 6, 7]])
    logits = torch.randn((1, V))
    row = SamplingRow(config=GenerationConfig(watermarking_config=case), prompt_ids=[5, 6], output_ids=[7])
    assert torch.equal(_ours(logits, [row]), logits)
    assert torch.equal(WatermarkingConfig(**case).construct_processor(V, "cpu")(ids, logits.clone()), logits)


@pytest.mark.parametrize("case", SYNTHID_CASES)
def test_synthid_processor_equals_transformers_step_by_step(case: dict[str, Any]) -> None:
    """One transformers processor called once per generated token (its state carried between calls)
    against our rows rebuilt from their tokens at each step; repeated contexts included."""
    gen = torch.Generator().manual_seed(1)
    hf = SynthIDTextWatermarkingConfig(**case).construct_processor(V, "cpu")
    assert isinstance(hf, SynthIDTextWatermarkLogitsProcessor)
    ids = torch.randint(0, V, (3, PROMPT_LEN), generator=gen)
    for step in range(24):
        logits = torch.randn((3, V), generator=gen) * 2
        expected = hf(ids, logits.clone())
        got = _ours(logits, _rows(case, ids))
        assert torch.equal(got, expected), f"step {step}"
        # every other token from a tiny alphabet: contexts repeat, and the history must catch them
        high = 3 if step % 2 else V
        ids = torch.cat([ids, torch.randint(0, high, (3, 1), generator=gen)], dim=1)


def test_watermarked_row_leaves_its_neighbours_alone() -> None:
    """Rows with other options (or with a different watermark) beside watermarked rows get exactly what
    they get alone."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (5, 12), generator=gen)
    logits = torch.randn((5, V), generator=gen)
    configs: list[GenerationConfig] = [
        GenerationConfig(),
        GenerationConfig(watermarking_config=GREENLIST_CASES[2]),
        GenerationConfig(do_sample=True, top_k=20, temperature=0.8),
        GenerationConfig(watermarking_config=SYNTHID_CASES[1], do_sample=True),
        GenerationConfig(repetition_penalty=1.3),
    ]
    rows = [
        SamplingRow(config=c, prompt_ids=r[:PROMPT_LEN].tolist(), output_ids=r[PROMPT_LEN:].tolist())
        for c, r in zip(configs, ids, strict=True)
    ]
    batched = _ours(logits, rows)
    for i, row in enumerate(rows):
        alone = _ours(logits[i : i + 1], [row])
        assert torch.equal(batched[i : i + 1], alone), f"row {i}"
    assert torch.equal(batched[0], logits[0])  # a plain greedy row is untouched


def test_watermark_comes_after_the_warpers() -> None:
    """As transformers' _get_logits_processor orders them: top-k first, then the bias."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (1, 9), generator=gen)
    logits = torch.randn((1, V), generator=gen)
    hf_topk = torch.topk(logits, 10).values[:, -1:]
    warped = logits.masked_fill(logits < hf_topk, float("-inf"))
    expected = WatermarkingConfig().construct_processor(V, "cpu")(ids, warped)
    got = _ours(logits, _rows({}, ids, do_sample=True, top_k=10))
    assert torch.equal(got, expected)


# ---------------------------------------------------------------------------------------- detection
@pytest.mark.parametrize("case", GREENLIST_CASES)
@pytest.mark.parametrize("ignore_repeated", [False, True])
def test_greenlist_detector_equals_transformers(case: dict[str, Any], ignore_repeated: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    model_config = PretrainedConfig(vocab_size=V, bos_token_id=BOS)
    hf = WatermarkDetector(
        model_config, "cpu", WatermarkingConfig(**case), ignore_repeated_ngrams=ignore_repeated
    )
    for high in (V, 12):  # a small alphabet repeats n-grams
        ids = torch.randint(3, high, (1, 40), generator=gen)
        ids[0, 0] = BOS
        expected = hf(ids, z_threshold=1.0, return_dict=True)
        got = detect_watermark(
            ids[0].tolist(),
            watermarking_config_from(case),  # type: ignore[arg-type]
            V,
            bos_token_id=BOS,
            z_threshold=1.0,
            ignore_repeated_ngrams=ignore_repeated,
        )
        assert got.num_tokens_scored == expected.num_tokens_scored[0]
        assert got.num_green_tokens == expected.num_green_tokens[0]
        assert got.green_fraction == expected.green_fraction[0]
        assert got.z_score == expected.z_score[0]
        assert got.p_value == expected.p_value[0]
        assert got.prediction == expected.prediction[0]


def test_greenlist_detector_needs_a_token_to_score() -> None:
    config = GreenlistWatermark(context_width=3)
    with pytest.raises(InvalidRequestError, match="at least 4 tokens") as info:
        detect_watermark([BOS, 5, 6, 7], config, V, bos_token_id=BOS)
    assert info.value.param == "tokens"


@pytest.mark.parametrize("case", SYNTHID_CASES[:3])
def test_synthid_detector_scores_equal_the_reference(case: dict[str, Any]) -> None:
    """transformers' g-values and masks (SynthIDTextWatermarkDetector's), scored with SynthID Text's
    mean and weighted-mean formulas."""
    gen = torch.Generator().manual_seed(5)
    processor = SynthIDTextWatermarkingConfig(**case).construct_processor(V, "cpu")
    ids = torch.randint(3, 8, (1, 60), generator=gen)
    ids[0, 50] = EOS
    g = processor.compute_g_values(ids).numpy().astype(np.float64)  # [1, n, depth]
    mask = (
        processor.compute_context_repetition_mask(ids)
        * processor.compute_eos_token_mask(ids, EOS)[:, case["ngram_len"] - 1 :]
    )
    config = watermarking_config_from(case)
    assert isinstance(config, SynthIDWatermark)
    assert torch.equal(synthid_mask(config, ids[0].tolist(), EOS), mask[0].bool())
    m = mask.numpy().astype(np.float64)
    depth = g.shape[-1]
    mean = (g * m[:, :, None]).sum() / (depth * m.sum())
    weights = np.linspace(10, 1, depth)
    weights *= depth / weights.sum()
    weighted = (g * weights * m[:, :, None]).sum() / (depth * m.sum())
    got = detect_watermark(ids[0].tolist(), config, V, eos_token_id=EOS)
    assert got.num_tokens_scored == int(m.sum())
    assert got.mean_score == pytest.approx(mean, rel=1e-12)
    assert got.weighted_mean_score == pytest.approx(weighted, rel=1e-12)
    assert got.num_green_tokens is None


def test_synthid_detector_separates_watermarked_from_plain_tokens() -> None:
    """Tokens drawn from the processor's own distribution (uniform logits, as debug_mode makes them)
    score high; uniform tokens do not."""
    config = SynthIDWatermark(ngram_len=3, keys=tuple(range(10, 30)))
    gen = torch.Generator().manual_seed(6)
    out: list[int] = []
    for _ in range(60):
        row = SamplingRow(config=GenerationConfig(watermarking_config=config), prompt_ids=[5], output_ids=out)
        logits = apply_logits_processors(torch.zeros((1, V)), [row])
        out.append(int(torch.multinomial(logits.softmax(-1)[0], 1, generator=gen)))
    marked = detect_watermark(out, config, V)
    plain = detect_watermark(torch.randint(0, V, (60,), generator=gen).tolist(), config, V)
    assert marked.prediction and marked.mean_score is not None and marked.mean_score > 0.6
    assert not plain.prediction


# ---------------------------------------------------------------------------------------- config
def test_config_from_dicts_and_transformers_objects() -> None:
    assert watermarking_config_from({"bias": 1}) == GreenlistWatermark(bias=1.0)
    assert watermarking_config_from(WatermarkingConfig(seeding_scheme="selfhash")) == GreenlistWatermark(
        seeding_scheme="selfhash"
    )
    synthid = watermarking_config_from(SynthIDTextWatermarkingConfig(ngram_len=5, keys=[1, 2]))
    assert synthid == SynthIDWatermark(ngram_len=5, keys=(1, 2))
    merged = GenerationConfig().merged(watermarking_config={"ngram_len": 3, "keys": [4]})
    assert merged.watermarking_config == SynthIDWatermark(ngram_len=3, keys=(4,))
    assert GenerationConfig().watermarking_config is None


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"greenlist_ratio": 1.0}, "watermarking_config.greenlist_ratio"),
        ({"greenlist_ratio": "0.5"}, "watermarking_config.greenlist_ratio"),
        ({"bias": float("nan")}, "watermarking_config.bias"),
        ({"seeding_scheme": "hash"}, "watermarking_config.seeding_scheme"),
        ({"context_width": 0}, "watermarking_config.context_width"),
        ({"hashing_key": 2**64}, "watermarking_config.hashing_key"),
        ({"colour": "green"}, "watermarking_config.colour"),
        ({"ngram_len": 5}, "watermarking_config.keys"),
        ({"keys": [1, 2]}, "watermarking_config.ngram_len"),
        ({"keys": [], "ngram_len": 3}, "watermarking_config.keys"),
        ({"keys": [1, "2"], "ngram_len": 3}, "watermarking_config.keys"),
        ({"keys": [1], "ngram_len": 1}, "watermarking_config.ngram_len"),
        ({"keys": [1], "ngram_len": 1025}, "watermarking_config.ngram_len"),
        ({"keys": list(range(65)), "ngram_len": 5}, "watermarking_config.keys"),
        (
            {"keys": [1], "ngram_len": 3, "sampling_table_size": 2**24 + 1},
            "watermarking_config.sampling_table_size",
        ),
        (
            {"keys": [1], "ngram_len": 3, "context_history_size": 0},
            "watermarking_config.context_history_size",
        ),
        ({"keys": [1], "ngram_len": 3, "debug_mode": 1}, "watermarking_config.debug_mode"),
        ({"keys": [1], "ngram_len": 3, "bias": 2.0}, "watermarking_config.bias"),
        ("lefthash", "watermarking_config"),
    ],
)
def test_bad_config_names_the_field(value: Any, field: str) -> None:
    with pytest.raises(GenerationConfigError) as info:
        GenerationConfig(watermarking_config=value)
    assert info.value.field == field
    assert str(info.value).startswith(field)
