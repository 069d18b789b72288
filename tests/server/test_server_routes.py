"""The non-generation routes: /tokenize, /detokenize, /v1/models, /version, /metrics, the OpenAPI docs,
and CORS (off by default, on with origins)."""

from __future__ import annotations

import json

import httpx
from fastapi.testclient import TestClient
from server_fixtures import MAX_MODEL_LEN, LiveServer

from server.app import build_app
from server.config import ServerConfig


def test_tokenize_prompt_and_detokenize_round_trip(live_server: LiveServer, http: httpx.Client) -> None:
    resp = http.post(
        "/tokenize", json={"model": live_server.model, "prompt": "Hello world", "return_token_strs": True}
    )
    assert resp.status_code == 200
    body = resp.json()
    expected = live_server.state.tokenizer.encode("Hello world", add_special_tokens=True)
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert len(body["token_strs"]) == len(expected)
    resp = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert resp.status_code == 200 and resp.json() == {"prompt": "Hello world"}


def test_tokenize_messages_matches_chat_template(live_server: LiveServer, http: httpx.Client) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}
    ]
    resp = http.post("/tokenize", json={"messages": messages})
    assert resp.status_code == 200
    expected = live_server.state.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi\nthere"}], add_generation_prompt=True, tokenize=True
    )
    assert resp.json()["tokens"] == list(expected)
    without = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < resp.json()["count"]


def test_tokenize_errors(http: httpx.Client) -> None:
    for body in ({}, {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}):
        resp = http.post("/tokenize", json=body)
        assert resp.status_code == 400 and set(resp.json()["error"]) == {"message", "type", "param", "code"}
    resp = http.post("/detokenize", json={"tokens": [-1]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tokens"
    resp = http.post("/tokenize", json={"model": "other", "prompt": "x"})
    assert resp.status_code == 404


def test_version_models_and_openapi(live_server: LiveServer, http: httpx.Client) -> None:
    assert http.get("/version").json()["version"]
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert (
        card["id"] == live_server.model
        and card["object"] == "model"
        and card["max_model_len"] == MAX_MODEL_LEN
    )
    schema = http.get("/openapi.json").json()
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/v1/watermark/detect",
        "/health",
    ):
        assert path in schema["paths"], path
    assert http.get("/docs").status_code == 200


def test_openapi_bounds_are_json_schema_keywords(http: httpx.Client) -> None:
    """pydantic's own ge/gt/le/lt keys (a Field bound over a before-validated number) would leave a bounded
    field unbounded to every client and fuzzer that reads the schema."""
    schema = http.get("/openapi.json").json()
    text = json.dumps(schema)
    assert not any(f'"{key}": ' in text for key in ("ge", "gt", "le", "lt")), "pydantic bound keys published"
    completion = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    number = {name: completion[name]["anyOf"][0] for name in ("temperature", "top_p", "diversity_penalty")}
    assert number["temperature"] == {"type": "number", "minimum": 0.0}
    assert number["top_p"] == {"type": "number", "exclusiveMinimum": 0.0, "maximum": 1.0}
    assert number["diversity_penalty"] == {"type": "number", "minimum": 0.0}
    assert completion["n"]["minimum"] == 1 and completion["best_of"]["anyOf"][0]["maximum"] == 64


def test_metrics_count_requests_and_steps(http: httpx.Client) -> None:
    assert (
        http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0}).status_code
        == 200
    )
    resp = http.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    values = {
        line.split(" ")[0]: float(line.split(" ")[-1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    finished = sum(v for k, v in values.items() if k.startswith("cbserve:request_success_total"))
    assert finished >= 1
    assert any(k.startswith("cbserve:iteration_tokens_total_count") and v >= 1 for k, v in values.items())
    assert any(k.startswith("cbserve:http_requests_total") and 'route="/v1/completions"' in k for k in values)


def test_cors_off_by_default_and_on_with_origins(live_server: LiveServer) -> None:
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    resp = httpx.options(live_server.base_url + "/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in resp.headers
    # An app with CORS on, over the same (already loaded) engine; its lifespan is not run: the preflight
    # and the auth check happen before any route.
    config = ServerConfig(served_model_name="m", api_key="k", cors_origins=("http://app.example",))
    client = TestClient(build_app(live_server.state.engine, config))
    answer = client.options("/v1/completions", headers=preflight)
    assert answer.status_code == 200
    assert answer.headers["access-control-allow-origin"] == "http://app.example"
    answer = client.get("/v1/models", headers={"Origin": "http://app.example"})
    assert answer.status_code == 401 and answer.headers["access-control-allow-origin"] == "http://app.example"
    assert "x-request-id" in answer.headers
