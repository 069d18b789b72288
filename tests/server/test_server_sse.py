"""Raw SSE read with httpx: the exact event order of chat and completion streams, usage chunks, echo,
and an engine failure after the stream started (an error event, then [DONE])."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from executor_faults import faulty_executor
from server_fixtures import LiveServer


def sse_events(server: LiveServer, path: str, body: dict[str, Any]) -> Iterator[Any]:
    """Each ``data:`` payload (parsed JSON, or the string ``[DONE]``) of a streamed response."""
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", server.base_url + path, json=body, headers=server.headers) as resp:
            assert resp.status_code == 200, resp.read()
            assert resp.headers["content-type"].startswith("text/event-stream")
            for line in resp.iter_lines():
                if not line:
                    continue
                assert line.startswith("data: "), line
                data = line[len("data: ") :]
                yield data if data == "[DONE]" else json.loads(data)


def test_chat_stream_event_order_with_usage(live_server: LiveServer) -> None:
    body = {
        "model": live_server.model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = list(sse_events(live_server, "/v1/chat/completions", body))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == live_server.model for c in chunks)
    assert all("usage" in c for c in chunks)  # include_usage: null on every chunk but the last
    first, *middle, finish, usage_chunk = chunks
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert first["usage"] is None
    assert middle, "expected at least one content delta"
    for c in middle:
        (choice,) = c["choices"]
        assert set(choice["delta"]) == {"content"} and choice["finish_reason"] is None
    (fin,) = finish["choices"]
    assert fin["delta"] == {} and fin["finish_reason"] in ("stop", "length")
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"] <= 6


def test_completion_stream_n2_echo(live_server: LiveServer) -> None:
    body = {
        "prompt": "Hello there",
        "max_tokens": 4,
        "temperature": 0,
        "n": 2,
        "echo": True,
        "stream": True,
    }
    events = list(sse_events(live_server, "/v1/completions", body))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("usage" not in c for c in chunks)  # no include_usage: no usage field at all
    texts: dict[int, str] = {0: "", 1: ""}
    finished: dict[int, str] = {}
    for c in chunks:
        assert c["object"] == "text_completion"
        (choice,) = c["choices"]
        i = choice["index"]
        assert i not in finished, "no text after a choice's finish_reason"
        texts[i] += choice["text"]
        if choice["finish_reason"] is not None:
            finished[i] = choice["finish_reason"]
    assert set(finished) == {0, 1}
    assert texts[0].startswith("Hello there") and texts[0] == texts[1]
    # the echo comes first, before any generated text
    assert chunks[0]["choices"][0]["text"] == "Hello there"


def test_failure_after_stream_start_is_an_error_event(live_server: LiveServer) -> None:
    manager = live_server.state.manager
    assert manager is not None and live_server.wait_idle()
    calls = {"n": 0}

    def fail_second_step(batch: Any) -> None:
        calls["n"] += 1
        if calls["n"] >= 2:
            raise RuntimeError("injected fault")

    body = {
        "prompt": "Count: one two",
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with faulty_executor(manager, before=fail_second_step):
        events = list(sse_events(live_server, "/v1/completions", body))
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert set(error) == {"error"}
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert "injected fault" in error["error"]["message"]
    assert live_server.wait_idle()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_error_before_start_is_http_error(live_server: LiveServer, path: str) -> None:
    body: dict[str, Any] = {"stream": True, "temperature": -1}
    body.update(
        {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    )
    resp = httpx.post(live_server.base_url + path, json=body, headers=live_server.headers, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "temperature"
