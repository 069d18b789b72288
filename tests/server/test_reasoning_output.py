"""Reasoning output in chat responses: ``reasoning_content`` (and ``reasoning``) apart from ``content``, in
messages and stream deltas; scripted without a model, and end to end with the live server's output
forced into the ``<think>…</think>`` shape by a regex (slow)."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import httpx
import pytest
from server_fixtures import LiveServer

from server.reasoning_output import ChatReasoning
from server.schemas import ChatResponseMessage

OUTPUT = "<think>\n2 + 2 is 4.\n</think>\n\nIt is 4."


def test_message_split() -> None:
    message = ChatReasoning(True).message(ChatResponseMessage(content=OUTPUT))
    assert message.reasoning_content == message.reasoning == "\n2 + 2 is 4.\n"
    assert message.content == "\n\nIt is 4."
    untouched = ChatReasoning(False).message(ChatResponseMessage(content=OUTPUT))
    assert untouched.content == OUTPUT and untouched.reasoning_content is None


def test_stream_deltas_concatenate_to_the_message() -> None:
    reasoning = ChatReasoning(True)
    pieces = ["<th", "ink>\n2 + 2", " is 4.\n</", "think>\n\nIt", " is 4."]
    deltas = [reasoning.delta(0, p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert deltas[0] == {}  # "<th" may be the start of "<think>": held back
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\n2 + 2 is 4.\n"
    assert "".join(d.get("content", "") for d in deltas) == "\n\nIt is 4."
    assert ChatReasoning(False).delta(0, "x", final=False) == {"content": "x"}
    assert ChatReasoning(False).delta(0, "", final=True) == {}


def test_choices_are_split_apart() -> None:
    reasoning = ChatReasoning(True, opened=True)
    assert reasoning.delta(0, "a</think>", final=False) == {"reasoning_content": "a", "reasoning": "a"}
    assert reasoning.delta(1, "b", final=False) == {"reasoning_content": "b", "reasoning": "b"}
    assert reasoning.delta(0, "c", final=True) == {"content": "c"}


# ----------------------------------------------------------------------------------- through HTTP (slow)
THINK_REGEX = r"<think>[a-z]{2,6}</think>[A-Z][a-z]{2,6}"
BODY = {
    "messages": [{"role": "user", "content": "Think, then name a color."}],
    "max_tokens": 40,
    "temperature": 0,
    "structured_outputs": {"regex": THINK_REGEX},
}


def _streamed(http: httpx.Client) -> tuple[str, str]:
    reasoning, content = "", ""
    with http.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                delta: dict[str, Any] = choice["delta"]
                assert delta.get("reasoning") == delta.get("reasoning_content")
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    return reasoning, content


def test_reasoning_through_http(
    http: httpx.Client, live_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    off = http.post("/v1/chat/completions", json=BODY).json()["choices"][0]["message"]
    assert re.fullmatch(THINK_REGEX, off["content"]) and off["reasoning_content"] is None  # no <think> token
    config = dataclasses.replace(live_server.state.config, reasoning_parser="think")
    monkeypatch.setattr(live_server.state, "config", config)
    on = http.post("/v1/chat/completions", json=BODY).json()["choices"][0]["message"]
    thought, answer = off["content"].removeprefix("<think>").split("</think>")
    assert (on["reasoning_content"], on["reasoning"], on["content"]) == (thought, thought, answer)
    assert _streamed(http) == (thought, answer)
