"""Server logits processors over HTTP on the default model (``--logits-processors
user_processor_fixtures:BanToken``): ``logits_processor_args`` on both endpoints bans the token it names
for that request alone, and a processor that fails for one request fails that request only, with an
OpenAI-style error (400 ``logits_processor_failed``, or an error event in a stream), never a 500."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from server_fixtures import LIVE_CONFIG, LiveServer, start_live_server

from engine.loader.model_loader import LoadedModel

PROMPT = "The capital of France is"
MAX_TOKENS = 12
SPEC = "user_processor_fixtures:BanToken"


@pytest.fixture(scope="module")
def server(default_model: LoadedModel) -> Iterator[LiveServer]:
    with start_live_server(LIVE_CONFIG, logits_processors=(SPEC,), loaded=default_model) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as c:
        yield c


def _body(**extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


def _complete(client: httpx.Client, **extra: Any) -> httpx.Response:
    return client.post("/v1/completions", json=_body(**extra))


def _first_token(server: LiveServer, text: str) -> int:
    return int(server.state.engine.tokenizer.encode(text, add_special_tokens=False)[0])


def test_logits_processor_args_ban_a_token_for_that_request(server: LiveServer, client: httpx.Client) -> None:
    plain = _complete(client)
    assert plain.status_code == 200, plain.text
    text = plain.json()["choices"][0]["text"]
    banned = _first_token(server, text)
    resp = _complete(client, logits_processor_args={"ban_token_id": banned})
    assert resp.status_code == 200, resp.text
    other = resp.json()["choices"][0]["text"]
    assert other != text and _first_token(server, other) != banned
    # args the processor does not read leave the request as it is
    same = _complete(client, logits_processor_args={"unrelated": 1})
    assert same.json()["choices"][0]["text"] == text


def test_chat_takes_logits_processor_args(server: LiveServer, client: httpx.Client) -> None:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    plain = client.post("/v1/chat/completions", json=body)
    assert plain.status_code == 200, plain.text
    text = plain.json()["choices"][0]["message"]["content"]
    banned = _first_token(server, text)
    resp = client.post(
        "/v1/chat/completions", json={**body, "logits_processor_args": {"ban_token_id": banned}}
    )
    assert resp.status_code == 200, resp.text
    other = resp.json()["choices"][0]["message"]["content"]
    assert other != text and _first_token(server, other) != banned


def test_a_failing_processor_fails_only_its_request(server: LiveServer, client: httpx.Client) -> None:
    plain = _complete(client).json()["choices"][0]["text"]
    banned = _first_token(server, plain)
    reference = _complete(client, logits_processor_args={"ban_token_id": banned}).json()["choices"][0]["text"]
    bodies = [
        _body(logits_processor_args={"fail": True}),
        _body(),
        _body(logits_processor_args={"ban_token_id": banned}),
        _body(logits_processor_args={"nan": True}),
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        resps = list(pool.map(lambda b: client.post("/v1/completions", json=b), bodies))
    for resp, why in ((resps[0], "RuntimeError('asked to fail')"), (resps[3], "NaN")):
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["code"] == "logits_processor_failed"
        assert f"logits processor {SPEC} failed" in error["message"] and why in error["message"]
    assert resps[1].status_code == 200 and resps[1].json()["choices"][0]["text"] == plain
    assert resps[2].status_code == 200 and resps[2].json()["choices"][0]["text"] == reference
    assert server.wait_idle()


def test_a_failing_processor_ends_a_stream_with_an_error_event(client: httpx.Client) -> None:
    with client.stream(
        "POST", "/v1/completions", json=_body(stream=True, logits_processor_args={"fail": True})
    ) as resp:
        assert resp.status_code == 200
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "logits_processor_failed" and "asked to fail" in error["message"]


def test_bad_logits_processor_args_are_a_400(client: httpx.Client) -> None:
    resp = _complete(client, logits_processor_args=[1, 2])
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "logits_processor_args"
    resp = _complete(client, logits_processors=["pkg.module:Class"])
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "logits_processors"
