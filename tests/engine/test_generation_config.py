"""GenerationConfig: defaults, validation messages, model defaults and request overrides."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import transformers

from engine.generation.config import DEFAULT_MAX_NEW_TOKENS, GenerationConfig, GenerationConfigError


def test_defaults_follow_transformers() -> None:
    ours = GenerationConfig()
    # transformers 5 leaves fields None and fills them from these defaults at generate() time
    defaults = transformers.GenerationConfig._get_default_generation_params()
    plain = transformers.GenerationConfig()
    for name in (
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "typical_p",
        "epsilon_cutoff",
        "eta_cutoff",
        "repetition_penalty",
        "no_repeat_ngram_size",
        "num_return_sequences",
        "max_new_tokens",
        "max_time",
    ):
        theirs = defaults.get(name, getattr(plain, name))
        assert getattr(ours, name) == theirs, name
    assert ours.min_new_tokens == 0 and ours.top_logprobs == 0 and ours.skip_special_tokens
    assert ours.is_greedy
    assert ours.max_new_tokens_or() == DEFAULT_MAX_NEW_TOKENS == 256


def test_greedy_when_temperature_zero() -> None:
    assert GenerationConfig(do_sample=True, temperature=0.0).is_greedy
    assert not GenerationConfig(do_sample=True, temperature=0.5).is_greedy


BAD: list[tuple[dict[str, Any], str]] = [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"typical_p": 0.0}, "typical_p"),
    ({"epsilon_cutoff": 1.0}, "epsilon_cutoff"),
    ({"eta_cutoff": -0.5}, "eta_cutoff"),
    ({"num_return_sequences": 0}, "num_return_sequences"),
    ({"top_logprobs": 21, "output_logprobs": True}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),  # needs output_logprobs
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"max_time": 0.0}, "max_time"),
    ({"max_time": float("inf")}, "max_time"),
    ({"no_repeat_ngram_size": -2}, "no_repeat_ngram_size"),
    ({"eos_token_id": -1}, "eos_token_id"),
    ({"stop_token_ids": [3, -4]}, "stop_token_ids"),
    ({"suppress_tokens": [1.5]}, "suppress_tokens"),
    ({"bad_words_ids": [[]]}, "bad_words_ids"),
    ({"bad_words_ids": [[1, -2]]}, "bad_words_ids"),
    ({"sequence_bias": {(1,): float("nan")}}, "sequence_bias"),
    ({"sequence_bias": {(): 1.0}}, "sequence_bias"),
    ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {-3: 1.0}}, "logit_bias"),
    ({"stop_strings": ""}, "stop_strings"),
    ({"stop_strings": ["ok", 3]}, "stop_strings"),
    ({"do_sample": "yes"}, "do_sample"),
    ({"top_k": True}, "top_k"),
    ({"seed": 1.5}, "seed"),
]


@pytest.mark.parametrize("kwargs,field", BAD, ids=[f for _, f in BAD])
def test_invalid_values_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(GenerationConfigError) as err:
        GenerationConfig(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")
    assert isinstance(err.value, ValueError)


def test_vocabulary_range_checks() -> None:
    cfg = GenerationConfig(logit_bias={10: 1.0}, bad_words_ids=[[1, 2]], stop_token_ids=[5])
    cfg.validate(vocab_size=11)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"logit_bias": {11: 1.0}}, "logit_bias"),
        ({"bad_words_ids": [[1, 20]]}, "bad_words_ids"),
        ({"sequence_bias": {(3, 11): 1.0}}, "sequence_bias"),
        ({"stop_token_ids": [11]}, "stop_token_ids"),
        ({"eos_token_id": [0, 11]}, "eos_token_id"),
        ({"suppress_tokens": [11]}, "suppress_tokens"),
        ({"begin_suppress_tokens": [12]}, "begin_suppress_tokens"),
    ]
    for kwargs, field in cases:
        GenerationConfig(**kwargs)  # fine without a vocabulary
        with pytest.raises(GenerationConfigError) as err:
            GenerationConfig(**kwargs).validate(vocab_size=11)
        assert err.value.field == field and "vocabulary" in str(err.value)


def test_normalization_of_json_shapes() -> None:
    as_json: dict[str, Any] = dict(  # the shapes JSON and HF's list forms give
        temperature=1,
        logit_bias={"7": 5},
        sequence_bias=[[[1, 2], -1], [[3], 2.5]],
        eos_token_id=(1, 2),
        stop_strings=("a", "b"),
    )
    cfg = GenerationConfig(**as_json)
    assert cfg.temperature == 1.0 and isinstance(cfg.temperature, float)
    assert cfg.logit_bias == {7: 5.0}
    assert cfg.sequence_bias == {(1, 2): -1.0, (3,): 2.5}
    assert cfg.eos_token_ids == (1, 2)
    assert cfg.stop_string_list == ["a", "b"]
    assert GenerationConfig(stop_strings="x").stop_string_list == ["x"]
    assert GenerationConfig(eos_token_id=4).eos_token_ids == (4,)


def test_from_model_defaults_ignores_unknown_keys_and_nulls() -> None:
    d = {
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "max_length": 4096,
        "transformers_version": "4.46.0",
        "top_k": None,
    }
    cfg = GenerationConfig.from_model_defaults(d)
    assert cfg.eos_token_id == [2, 3] and cfg.do_sample and cfg.temperature == 0.6 and cfg.top_p == 0.9
    assert cfg.top_k == 50
    assert GenerationConfig.from_model_defaults({}) == GenerationConfig()
    assert GenerationConfig.from_model_defaults(None) == GenerationConfig()
    with pytest.raises(GenerationConfigError):
        GenerationConfig.from_model_defaults({"temperature": -1})


def test_merged_overrides_and_validates() -> None:
    base = GenerationConfig.from_model_defaults({"temperature": 0.6, "do_sample": True, "top_p": 0.9})
    req = base.merged(temperature=0.0, max_new_tokens=12, top_p=None, seed=3)
    assert req.temperature == 0.0 and req.max_new_tokens == 12 and req.seed == 3
    assert req.top_p == 0.9, "None means the request did not set it"
    assert req.is_greedy
    assert base.temperature == 0.6, "merged returns a new config"
    with pytest.raises(GenerationConfigError) as err:
        base.merged(temprature=0.5)
    assert err.value.field == "temprature" and "unknown" in str(err.value)
    with pytest.raises(GenerationConfigError) as err:
        base.merged(top_p=2.0)
    assert err.value.field == "top_p"


def test_config_is_frozen() -> None:
    cfg = GenerationConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.temperature = 2.0  # type: ignore[misc]
