"""Grammar bombs: structured outputs whose grammar is pathological (nesting past the library's depth
limit, every combination of 20 choices, a regex that explodes into lexer states, an enum of 100,000
values, a tool's parameters that intersect 19 regexes) are each a 400 naming the field, saying the spec is too complex
(or too large), and the server serves on. A compilation that runs past ``--grammar-compile-timeout``
(one held open by the test, so that the outcome does not depend on the machine's speed) answers its
request with that 400 while the compilation is still under way, and meanwhile other requests, plain and
constrained, stream to the end: compiling never blocks the event loop or the engine.

A dedicated server (``start_live_server``) with a short compile timeout and the default body limit.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from grammar_bombs import all_of_choices, nested_schema
from server_fixtures import LiveServer, start_live_server

from engine.generation.grammar import CompiledGrammar, GrammarCompiler
from engine.generation.grammar_spec import GrammarSpec
from engine.loader.model_loader import LoadedModel
from server.config import ServerConfig

COMPILE_TIMEOUT_S = 3.0
GATE_TIMEOUT_S = 120.0  # the held compilation is released by the test long before this
MAX_TOKENS = 8
HELD = "held-by-the-test"

pytestmark = pytest.mark.slow  # the real model behind its own server


@pytest.fixture(scope="module")
def server(default_model: LoadedModel) -> Iterator[LiveServer]:
    config = ServerConfig(served_model_name="grammar", grammar_compile_timeout=COMPILE_TIMEOUT_S)
    with start_live_server(
        config, loaded=default_model, num_blocks=128, max_model_len=1024, max_num_seqs=4
    ) as server:
        yield server


def patterns_all_at_once(count: int) -> dict[str, Any]:
    """A string matching ``count`` regexes at once: the lexer must intersect them (a few hundred bytes)."""
    return {"allOf": [{"type": "string", "pattern": f"^(a|b)*a(a|b){{{i}}}$"} for i in range(1, count)]}


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "bomb", "schema": schema}}


CHAT = {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": MAX_TOKENS}
COMPLETION = {"prompt": "Answer:", "max_tokens": MAX_TOKENS}

# (id, path, body, param, words in the message)
BOMBS: list[tuple[str, str, dict[str, Any], str, str]] = [
    ("deep-nesting", "/v1/chat/completions", {**CHAT, "response_format": schema_format(nested_schema(300))},
     "response_format.json_schema.schema", "too complex"),
    ("all-of-choices", "/v1/completions", {**COMPLETION, "structured_outputs": {"json": all_of_choices(20)}},
     "structured_outputs.json", "too complex"),
    ("regex-blowup", "/v1/completions", {**COMPLETION, "guided_regex": "(.{0,100}){0,100}x"},
     "guided_regex", "too complex"),
    ("huge-enum", "/v1/chat/completions",
     {**CHAT, "response_format": schema_format({"enum": [f"value-{i}" for i in range(100_000)]})},
     "response_format.json_schema.schema", "too large"),
    ("tool-parameters", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
         "type": "object", "properties": {"x": patterns_all_at_once(20)}, "required": ["x"]}}}],
      "tool_choice": "required"}, "tools", "too complex"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param", "words"), [b[1:] for b in BOMBS], ids=[b[0] for b in BOMBS]
)
def test_a_grammar_bomb_is_a_400_naming_its_field(
    server: LiveServer, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    resp = httpx.post(server.base_url + path, json=body, timeout=60)
    assert resp.status_code == 400, resp.text[:500]
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert words in error["message"], error
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    assert server.wait_idle(timeout=30)


@pytest.fixture
def held_compilation(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """(entered, gate): compiling a spec that mentions ``HELD`` sets ``entered`` and waits for ``gate``."""
    entered, gate = threading.Event(), threading.Event()
    compile_spec = GrammarCompiler.compile

    def held(self: GrammarCompiler, spec: GrammarSpec) -> CompiledGrammar:
        if HELD in spec.text:
            entered.set()
            gate.wait(GATE_TIMEOUT_S)
        return compile_spec(self, spec)

    monkeypatch.setattr(GrammarCompiler, "compile", held)
    yield entered, gate
    gate.set()


async def stream_to_the_end(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[Any]:
    """Every event of a stream that must complete; returns the chunks."""
    async with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, await resp.aread()
        events = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    return chunks


def test_a_compilation_past_the_timeout_is_a_400_while_others_stream(
    server: LiveServer, held_compilation: tuple[threading.Event, threading.Event]
) -> None:
    entered, gate = held_compilation
    assert server.wait_idle(timeout=30)

    async def scenario() -> tuple[httpx.Response, bool]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            held = asyncio.create_task(
                client.post("/v1/completions", json={**COMPLETION, "guided_regex": f"{HELD}[a-z]*"})
            )
            assert await asyncio.to_thread(entered.wait, GATE_TIMEOUT_S)
            # While that grammar compiles (held), a plain stream and a constrained one run to the end.
            plain = {**COMPLETION, "ignore_eos": True, "temperature": 0}
            chunks = await stream_to_the_end(client, "/v1/completions", plain)
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            constrained = {**CHAT, "response_format": schema_format({"type": "object"}), "temperature": 0}
            chunks = await stream_to_the_end(client, "/v1/chat/completions", constrained)
            assert chunks[-1]["choices"][0]["finish_reason"] is not None
            resp = await held
            return resp, gate.is_set()

    resp, released = asyncio.run(asyncio.wait_for(scenario(), GATE_TIMEOUT_S))
    assert not released  # the answer came while its compilation was still held: the wait is bounded
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "guided_regex" and "too complex" in error["message"], error
    assert f"{COMPILE_TIMEOUT_S:g} s" in error["message"], error
    gate.set()
    assert server.wait_idle(timeout=30)
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


UNWRITABLE = "\U000bf838"  # SmolLM2's vocabulary has no token for its UTF-8 lead byte 0xF2


def test_a_character_the_vocabulary_cannot_write_is_a_400_never_a_500(server: LiveServer) -> None:
    """Spelt out (a choice option), it is refused at admission naming the field; written as a regex escape
    (found only while generating), the request fails alone as its own options' fault: a 400, or in a
    stream an error event with that code, never a 500."""
    url = server.base_url + "/v1/completions"
    resp = httpx.post(url, json={**COMPLETION, "guided_choice": ["yes", f"no{UNWRITABLE}"]}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "guided_choice" and "U+BF838" in error["message"], error
    escaped = {**COMPLETION, "guided_regex": "\\x{BF838}"}
    resp = httpx.post(url, json=escaped, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "invalid_generation_options", resp.text
    with httpx.stream("POST", url, json={**escaped, "stream": True}, timeout=60) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "invalid_generation_options"
    assert server.wait_idle(timeout=30)
