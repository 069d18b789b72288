"""Every error the server sends: status and OpenAI's body ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_fixtures import MAX_BODY_BYTES, MAX_MODEL_LEN, LiveServer

import server.serving_completions


def assert_error(
    resp: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return dict(error)


COMPLETION = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize(
    ("path", "override", "param"),
    [
        ("/v1/completions", {"temperature": -1}, "temperature"),
        ("/v1/completions", {"top_p": 1.5}, "top_p"),
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"logprobs": 30}, "logprobs"),
        ("/v1/completions", {"presence_penalty": 3}, "presence_penalty"),
        ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 500}}, "logit_bias"),
        ("/v1/completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ("/v1/completions", {"stop": 5}, "stop"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": [1, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": None}, "prompt"),
        ("/v1/completions", {"stop_token_ids": [10**9]}, "stop_token_ids"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
        ),
    ],
)
def test_invalid_values_are_400_naming_the_field(
    http: httpx.Client, path: str, override: dict[str, Any], param: str
) -> None:
    body = {**(COMPLETION if path == "/v1/completions" else CHAT), **override}
    error = assert_error(http.post(path, json=body), 400, param=param)
    assert error["type"] == "invalid_request_error"


def test_missing_field_and_malformed_json(http: httpx.Client) -> None:
    error = assert_error(http.post("/v1/completions", json={"max_tokens": 2}), 400, param="prompt")
    assert "prompt" in error["message"]
    error = assert_error(
        http.post(
            "/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"}
        ),
        400,
    )
    assert "JSON" in error["message"]


def test_context_length_exceeded(http: httpx.Client) -> None:
    error = assert_error(
        http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": MAX_MODEL_LEN + 10}),
        400,
        code="context_length_exceeded",
    )
    assert str(MAX_MODEL_LEN) in error["message"]
    long_prompt = list(range(100, 100 + MAX_MODEL_LEN + 5))  # token ids: no tokenization ambiguity
    error = assert_error(
        http.post("/v1/completions", json={"prompt": long_prompt}), 400, code="context_length_exceeded"
    )
    assert str(MAX_MODEL_LEN + 5) in error["message"] and str(MAX_MODEL_LEN) in error["message"]
    assert_error(
        http.post("/v1/chat/completions", json={**CHAT, "max_tokens": MAX_MODEL_LEN}),
        400,
        param="messages",
        code="context_length_exceeded",
    )


def test_options_that_leave_nothing_to_sample_are_400(live_server: LiveServer, http: httpx.Client) -> None:
    """Found by fuzzing: repetition_penalty 5e-324 is > 0, but 0 in float32, so dividing the logits by it
    gives +inf. Only generation finds that out: the request fails alone, as a client error, and frees its
    blocks -- in a plain response and in a stream."""
    body = {**CHAT, "max_tokens": 3, "repetition_penalty": 5e-324}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, code="invalid_generation_options")
    assert error["type"] == "invalid_request_error" and "no token that can be sampled" in error["message"]
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200  # the stream had started: the error travels in it
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "invalid_generation_options"
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    assert live_server.wait_idle()


def test_unknown_route_method_and_model(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)
    assert_error(http.post("/v1/completions", json={**COMPLETION, "model": "gpt-4"}), 404, param="model")
    assert_error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"}), 404, param="model")


def test_api_key_required_except_open_routes(live_server: LiveServer) -> None:
    url = live_server.base_url
    assert_error(httpx.post(url + "/v1/completions", json=COMPLETION), 401, code="invalid_api_key")
    wrong = {"Authorization": "Bearer wrong-key"}
    assert_error(httpx.post(url + "/v1/completions", json=COMPLETION, headers=wrong), 401)
    basic = {"Authorization": f"Basic {live_server.api_key}"}
    assert_error(httpx.get(url + "/v1/models", headers=basic), 401)
    assert_error(httpx.post(url + "/tokenize", json={"prompt": "x"}), 401)
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(url + path).status_code == 200, path


def test_body_too_large(live_server: LiveServer) -> None:
    url = live_server.base_url + "/v1/completions"
    big = {"prompt": "x" * (MAX_BODY_BYTES + 10)}
    assert_error(httpx.post(url, json=big, headers=live_server.headers), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the streamed size is what counts
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    headers = {**live_server.headers, "content-type": "application/json"}
    assert_error(httpx.post(url, content=chunks(), headers=headers, timeout=60), 413)


def test_queue_full_is_429(live_server: LiveServer, http: httpx.Client) -> None:
    manager = live_server.state.manager
    assert manager is not None
    saved = manager.max_queue
    manager.max_queue = 0  # every admission finds the waiting queue full
    try:
        assert_error(http.post("/v1/completions", json=COMPLETION), 429, code="queue_full")
    finally:
        manager.max_queue = saved
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_draining_and_dead_engine_are_503(live_server: LiveServer, http: httpx.Client) -> None:
    state = live_server.state
    state.draining = True
    try:
        assert_error(http.post("/v1/completions", json=COMPLETION), 503, code="server_draining")
        assert_error(http.get("/health"), 503)
    finally:
        state.draining = False
    manager, state.manager = state.manager, None  # as if the engine loop were gone
    try:
        assert_error(http.post("/v1/chat/completions", json=CHAT), 503, code="engine_dead")
        assert_error(http.get("/health"), 503)
    finally:
        state.manager = manager
    assert http.get("/health").status_code == 200


def test_unexpected_exception_is_500_with_error_body(
    http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(server.serving_completions, "completion_prompts", boom)
    error = assert_error(http.post("/v1/completions", json=COMPLETION), 500)
    assert error["type"] == "server_error"


def test_unknown_fields_ignored_and_logged_once(http: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="server.serving_common"):
        for _ in range(2):
            resp = http.post("/v1/completions", json={**COMPLETION, "frobnicate_xyz": 1})
            assert resp.status_code == 200
    assert sum("frobnicate_xyz" in r.getMessage() for r in caplog.records) == 1


def test_request_id_echoed_on_success_and_error(http: httpx.Client) -> None:
    resp = http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "my-req-42"})
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "my-req-42"
    assert resp.json()["id"] == "cmpl-my-req-42"
    resp = http.post("/v1/completions", json={**COMPLETION, "n": 0}, headers={"X-Request-Id": "my-req-43"})
    assert resp.status_code == 400 and resp.headers["x-request-id"] == "my-req-43"
    assert http.get("/v1/models").headers.get("x-request-id")  # a fresh one when none is sent
    assert_error(
        http.get("/v1/models", headers={"X-Request-Id": "bad id\twith tab"}), 400, param="X-Request-Id"
    )
