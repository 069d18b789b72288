"""Watermarking over HTTP on the default model: ``watermarking_config`` on /v1/completions and
/v1/chat/completions, ``POST /v1/watermark/detect`` (transformers' WatermarkDetector numbers), its errors,
and a server default (``ServerConfig.watermarking_config``, the ``--watermarking-config`` flag)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import pytest
import torch
from server_fixtures import LIVE_CONFIG, LiveServer, start_live_server
from transformers import PretrainedConfig, WatermarkingConfig
from transformers.generation.watermarking import WatermarkDetector

from engine.loader.model_loader import LoadedModel

PROMPTS = ["The capital of France is", "Write a short story about a dragon:", "Explain how rain forms."]
NUM_TOKENS = 40
LEFTHASH = {"bias": 4.0, "hashing_key": 104729}
SYNTHID = {"ngram_len": 4, "keys": list(range(100, 120))}
GREENLIST_FIELDS = {
    "num_tokens_scored",
    "num_green_tokens",
    "green_fraction",
    "z_score",
    "p_value",
    "prediction",
}


def _complete(http: httpx.Client, seed: int, **extra: Any) -> list[str]:
    body = {
        "prompt": PROMPTS,
        "max_tokens": NUM_TOKENS,
        "min_tokens": NUM_TOKENS,
        "temperature": 1.0,
        "seed": seed,
        **extra,
    }
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    return [c["text"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]


def _detect(http: httpx.Client, **body: Any) -> dict[str, Any]:
    resp = http.post("/v1/watermark/detect", json=body)
    assert resp.status_code == 200, resp.text
    found: dict[str, Any] = resp.json()
    return found


def test_completions_watermark_is_detected_and_plain_text_is_not(http: httpx.Client) -> None:
    marked = _complete(http, 1, watermarking_config=LEFTHASH)
    plain = _complete(http, 1)
    for text in marked:
        found = _detect(http, text=text, watermarking_config=LEFTHASH)
        assert set(found) == GREENLIST_FIELDS
        assert found["prediction"] is True, (text, found)
    for text in plain:
        assert _detect(http, text=text, watermarking_config=LEFTHASH)["prediction"] is False, text


def test_chat_synthid_watermark_is_detected(http: httpx.Client) -> None:
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        body = {"messages": messages, "max_tokens": NUM_TOKENS, "min_tokens": NUM_TOKENS, "seed": 3}
        marked = http.post("/v1/chat/completions", json={**body, "watermarking_config": SYNTHID})
        plain = http.post("/v1/chat/completions", json=body)
        assert marked.status_code == 200 and plain.status_code == 200
        found = _detect(
            http, text=marked.json()["choices"][0]["message"]["content"], watermarking_config=SYNTHID
        )
        assert set(found) == {
            "num_tokens_scored",
            "mean_score",
            "weighted_mean_score",
            "z_score",
            "p_value",
            "prediction",
        }
        assert found["prediction"] is True and found["mean_score"] > 0.5
        text = plain.json()["choices"][0]["message"]["content"]
        assert _detect(http, text=text, watermarking_config=SYNTHID)["prediction"] is False


def test_detect_numbers_equal_transformers(live_server: LiveServer, http: httpx.Client) -> None:
    engine = live_server.state.engine
    model_config = PretrainedConfig(
        vocab_size=engine.vocab_size, bos_token_id=engine.model_config.bos_token_id
    )
    config = {"seeding_scheme": "selfhash", "context_width": 2, "greenlist_ratio": 0.4}
    ids = engine.tokenizer.encode(
        "It was the best of times, it was the worst of times, it was the age of wisdom"
    )
    hf = WatermarkDetector(model_config, "cpu", WatermarkingConfig(**config))
    expected = hf(torch.tensor([ids]), z_threshold=1.5, return_dict=True)
    found = _detect(http, tokens=ids, watermarking_config=config, z_threshold=1.5)
    for name in GREENLIST_FIELDS:
        assert found[name] == getattr(expected, name)[0], name


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"watermarking_config": LEFTHASH}, "text"),
        ({"text": "a b c", "tokens": [1, 2, 3], "watermarking_config": LEFTHASH}, "text"),
        ({"text": "some words to score"}, "watermarking_config"),
        ({"text": "some words to score", "watermarking_config": {"bias": "big"}}, "watermarking_config.bias"),
        (
            {"text": "some words to score", "watermarking_config": {"ngram_len": 3}},
            "watermarking_config.keys",
        ),
        ({"text": "some words to score", "watermarking_config": "lefthash"}, "watermarking_config"),
        ({"tokens": [5, 6, 10**9], "watermarking_config": LEFTHASH}, "tokens"),
        ({"tokens": [5], "watermarking_config": LEFTHASH}, "tokens"),
        ({"text": "Hi", "watermarking_config": SYNTHID}, "text"),
        ({"tokens": list(range(600)), "watermarking_config": LEFTHASH}, "tokens"),
        ({"tokens": [5, 6, 7], "watermarking_config": LEFTHASH, "z_threshold": "3"}, "z_threshold"),
        ({"tokens": [5, 6, 7], "watermarking_config": LEFTHASH, "model": "other"}, "model"),
    ],
)
def test_detect_errors_name_the_field(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    resp = http.post("/v1/watermark/detect", json=body)
    assert resp.status_code in (400, 404), resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_bad_watermark_on_generation_is_a_400_naming_the_field(http: httpx.Client, route: str) -> None:
    body: dict[str, Any] = {"max_tokens": 2, "watermarking_config": {"seeding_scheme": "middlehash"}}
    body.update(
        {"prompt": "Hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    resp = http.post(route, json=body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "watermarking_config.seeding_scheme" and "middlehash" in error["message"]


# ---------------------------------------------------------------------------------------- server default
@pytest.fixture(scope="module")
def default_server(default_model: LoadedModel) -> Iterator[httpx.Client]:
    config = replace(LIVE_CONFIG, served_model_name="smollm2-watermarked", watermarking_config=LEFTHASH)
    with start_live_server(config, loaded=default_model) as live:
        with httpx.Client(base_url=live.base_url, headers=live.headers, timeout=60) as client:
            yield client


@pytest.mark.slow
def test_server_default_watermarks_requests_that_name_none(default_server: httpx.Client) -> None:
    other = {"bias": 4.0, "hashing_key": 7}
    for text in _complete(default_server, 4):
        assert _detect(default_server, text=text)["prediction"] is True, text  # the default, both ways
    for text in _complete(default_server, 4, watermarking_config=other):
        assert _detect(default_server, text=text, watermarking_config=other)["prediction"] is True, text
        assert _detect(default_server, text=text)["prediction"] is False, text
