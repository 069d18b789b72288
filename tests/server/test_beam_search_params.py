"""vLLM's beam-search fields over HTTP (server/beam_search_params.py): what they become in the engine's
config, the 400s naming the field, and a beam search answered through the live server."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from engine.generation.config import GenerationConfig
from server.beam_search_params import beam_search_options
from server.errors import APIError
from server.generation_params import build_generation_config
from server.schemas import CompletionRequest


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **fields})


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, {}),
        ({"n": 2, "best_of": 2, "use_beam_search": False, "length_penalty": 1}, {}),
        ({"use_beam_search": True, "n": 2}, {"num_beams": 2}),
        ({"use_beam_search": True, "n": 2, "best_of": 4}, {"num_beams": 4}),
        ({"use_beam_search": True, "num_beams": 3}, {"num_beams": 3}),
        ({"num_beams": 5, "n": 3, "length_penalty": 0.5, "early_stopping": "never"}, {"num_beams": 5}),
        ({"num_beams": 4, "temperature": 0.7, "seed": 3}, {"num_beams": 4, "do_sample": True}),
        (
            {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5},
            {"num_beams": 4, "num_beam_groups": 2},
        ),
        ({"num_beams": 3, "force_words_ids": [[5, 6], [[7], [8, 9]]]}, {"num_beams": 3}),
    ],
)
def test_beam_fields_become_engine_options(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    options = beam_search_options(completion(**fields))
    assert {k: v for k, v in options.items() if k in expected} == expected
    config = build_generation_config(completion(**fields), GenerationConfig(), 8, False, 0)
    assert config.num_beams == expected.get("num_beams", 1)
    if config.num_beams > 1:
        assert config.num_return_sequences == fields.get("n", 1)
        assert config.do_sample is expected.get("do_sample", False)
        assert config.length_penalty == fields.get("length_penalty", 1.0)
        assert config.early_stopping == fields.get("early_stopping", False)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"best_of": 3}, "best_of"),
        ({"length_penalty": 0.5}, "length_penalty"),
        ({"early_stopping": True}, "early_stopping"),
        ({"num_beam_groups": 2}, "num_beam_groups"),
        ({"diversity_penalty": 0.5}, "diversity_penalty"),
        ({"force_words_ids": [[5]]}, "force_words_ids"),
        ({"use_beam_search": True, "n": 3, "best_of": 2}, "best_of"),
        ({"num_beams": 2, "n": 3}, "num_beams"),
        ({"use_beam_search": True, "best_of": 2, "num_beams": 3}, "num_beams"),
        ({"use_beam_search": True, "stream": True}, "use_beam_search"),
        ({"num_beams": 2, "stream": True}, "num_beams"),
    ],
)
def test_beam_fields_that_cannot_work_are_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        beam_search_options(completion(**fields))
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize(
    "fields",
    [{"num_beams": 0}, {"best_of": 65}, {"early_stopping": "sometimes"}, {"use_beam_search": 1}],
)
def test_out_of_range_beam_fields_are_refused_by_the_schema(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        completion(**fields)


# ----------------------------------------------------------------------------------- through HTTP (slow)
BODY = {"prompt": "The capital of France is", "max_tokens": 8}


def test_http_beam_search_returns_n_of_best_of_beams_best_first(http: httpx.Client) -> None:
    resp = http.post(
        "/v1/completions", json={**BODY, "use_beam_search": True, "n": 2, "best_of": 3, "logprobs": 1}
    )
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["text"] != choices[1]["text"]
    again = http.post("/v1/completions", json={**BODY, "num_beams": 3, "n": 2, "logprobs": 1}).json()[
        "choices"
    ]
    assert [c["text"] for c in again] == [c["text"] for c in choices]  # deterministic: the same search
    scores = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"]) for c in choices]
    assert scores[0] >= scores[1] - 1e-4  # best first (length_penalty 1: the mean log-probability)


def test_http_beams_with_stream_is_a_400(http: httpx.Client) -> None:
    resp = http.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "use_beam_search": True,
            "stream": True,
        },
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "use_beam_search"


def test_http_diverse_and_constrained_beams(http: httpx.Client) -> None:
    diverse = {**BODY, "num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 2.0, "n": 2}
    resp = http.post("/v1/completions", json=diverse)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 2
    forced = http.post("/tokenize", json={"prompt": " Lyon", "add_special_tokens": False}).json()["tokens"]
    resp = http.post("/v1/completions", json={**BODY, "num_beams": 3, "force_words_ids": [forced]})
    assert resp.status_code == 200, resp.text
    assert "Lyon" in resp.json()["choices"][0]["text"]
    bad = http.post("/v1/completions", json={**diverse, "num_beam_groups": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "num_beam_groups"
