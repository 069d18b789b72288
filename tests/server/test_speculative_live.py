"""Speculative decoding over HTTP: a server started with a speculative config (``--speculative-config``)
gives the same completions as plain decoding, streamed or not, per-request prompt lookup too, counts its
drafts in /metrics, and refuses bad options with a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_fixtures import LiveServer, start_live_server

from engine.speculative.config import SpeculativeConfig

pytestmark = pytest.mark.slow

PASSAGE = (
    "Repeat this sentence exactly, then stop: The quick brown fox jumps over the lazy dog while the farmer "
    "watches from the old wooden porch."
)


@pytest.fixture(scope="module")
def spec_server() -> Iterator[LiveServer]:
    config = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_max=3)
    with start_live_server(speculative_config=config, batch_invariant=True) as server:
        yield server


@pytest.fixture(scope="module")
def client(spec_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=spec_server.base_url, headers=spec_server.headers, timeout=120) as c:
        yield c


def chat(client: httpx.Client, **extra: Any) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": PASSAGE}],
        "max_tokens": 40,
        "temperature": 0,
    }
    resp = client.post("/v1/chat/completions", json={**body, **extra})
    assert resp.status_code == 200, resp.text
    return resp.json()


def counter(client: httpx.Client, name: str) -> float:
    text = client.get("/metrics").text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"cbserve:{name}")]
    return sum(values)


def test_speculating_server_answers_as_plain_decoding_and_counts_drafts(client: httpx.Client) -> None:
    drafts_before = counter(client, "spec_decode_num_drafts_total")
    speculated = chat(client)["choices"][0]["message"]["content"]
    accepted = counter(client, "spec_decode_num_accepted_tokens_total")
    assert counter(client, "spec_decode_num_drafts_total") > drafts_before
    assert accepted > 0 and counter(client, "spec_decode_num_accepted_tokens_per_pos_total{model_name") > 0
    plain = chat(client, prompt_lookup_num_tokens=0)["choices"][0]["message"]["content"]  # off for this one
    assert speculated == plain and "porch" in plain


def test_streamed_speculation_equals_the_whole_answer(client: httpx.Client) -> None:
    whole = chat(client)["choices"][0]["message"]["content"]
    body = {
        "messages": [{"role": "user", "content": PASSAGE}],
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
    }
    pieces = []
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                pieces.append(delta.get("content") or "")
    assert "".join(pieces) == whole


def test_per_request_prompt_lookup_and_bad_options(client: httpx.Client) -> None:
    tuned = chat(
        client, num_assistant_tokens=2, num_assistant_tokens_schedule="constant", max_matching_ngram_size=4
    )
    assert tuned["choices"][0]["message"]["content"] == chat(client)["choices"][0]["message"]["content"]
    for extra, param in (
        ({"prompt_lookup_num_tokens": 99}, "prompt_lookup_num_tokens"),
        ({"num_assistant_tokens": 0}, "num_assistant_tokens"),
        ({"num_assistant_tokens_schedule": "sometimes"}, "num_assistant_tokens_schedule"),
        ({"prompt_lookup_num_tokens": "4"}, "prompt_lookup_num_tokens"),
    ):
        body = {"messages": [{"role": "user", "content": "hi"}], **extra}
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400, resp.text
        assert param in (resp.json()["error"]["param"] or ""), resp.json()


def test_prompt_lookup_on_a_server_without_speculation(http: httpx.Client) -> None:
    body = {"prompt": PASSAGE, "max_tokens": 24, "temperature": 0}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    resp = http.post("/v1/completions", json={**body, "prompt_lookup_num_tokens": 3})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == plain
    resp = http.post("/v1/completions", json={**body, "num_assistant_tokens": 3})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "num_assistant_tokens"
