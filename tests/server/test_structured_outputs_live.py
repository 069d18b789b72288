"""Structured outputs and forced tool calls through HTTP with the official ``openai`` client, on the real
default model (SmolLM2-135M-Instruct): every constrained output must be valid by construction, whatever
this small model would say on its own."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from server_fixtures import LiveServer, wait_until

pytestmark = pytest.mark.slow

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Describe a person as JSON."}]

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "integer"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 10},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum_and_numbers": {
        "type": "object",
        "properties": {
            "role": {"enum": ["admin", "user", "guest"]},
            "score": {"type": "number", "minimum": 0, "maximum": 10},
            "age": {"type": "integer", "minimum": 1, "maximum": 120},
        },
        "required": ["role", "score", "age"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 20},
            "note": {"type": "string", "maxLength": 20},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
}

WEATHER_TOOL: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOL_CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{live_server.base_url}/v1", api_key=live_server.api_key, max_retries=0, timeout=180
    )


def _schema_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)
    role: Literal["admin", "user"]


def test_parse_with_a_pydantic_model(live_server: LiveServer, client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=live_server.model, messages=CHAT, response_format=Person, max_tokens=80, temperature=0
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(
    live_server: LiveServer, client: openai.OpenAI, name: str, temperature: float
) -> None:
    schema = SCHEMAS[name]
    resp = client.chat.completions.create(
        model=live_server.model,
        messages=CHAT,
        response_format=_schema_format(schema),
        max_tokens=120,
        temperature=temperature,
        seed=7,
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_json_object_on_completions(live_server: LiveServer, client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=live_server.model,
        prompt="Alice is 30. As JSON:",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert resp.choices[0].finish_reason == "stop", resp.choices[0].text
    assert isinstance(json.loads(resp.choices[0].text), dict)


def test_regex_and_choice(live_server: LiveServer, client: openai.OpenAI) -> None:
    pattern = r"[0-9]{3}-[A-Z]{2}"
    resp = client.chat.completions.create(
        model=live_server.model, messages=CHAT, max_tokens=20, extra_body={"guided_regex": pattern}
    )
    assert re.fullmatch(pattern, resp.choices[0].message.content or "")
    resp = client.chat.completions.create(
        model=live_server.model,
        messages=[{"role": "user", "content": "Is the sky green?"}],
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    )
    assert resp.choices[0].message.content in ("yes", "no", "maybe")


def test_n_samples_with_a_regex(live_server: LiveServer, client: openai.OpenAI) -> None:
    pattern = r"(red|green|blue) [a-z]{2,8}"
    resp = client.chat.completions.create(
        model=live_server.model,
        messages=CHAT,
        n=4,
        max_tokens=20,
        temperature=1.2,
        seed=3,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert len(resp.choices) == 4
    for choice in resp.choices:
        assert re.fullmatch(pattern, choice.message.content or ""), choice.message.content


def test_a_grammar_that_cannot_finish_ends_with_length(
    live_server: LiveServer, client: openai.OpenAI
) -> None:
    resp = client.chat.completions.create(
        model=live_server.model, messages=CHAT, max_tokens=3, extra_body={"guided_regex": "[a-z]{50}"}
    )
    assert resp.choices[0].finish_reason == "length"


def test_open_ended_schemas_close_before_max_tokens(live_server: LiveServer) -> None:
    """The schemas agent frameworks send (no maxLength, maxItems or maximum) and the prompts on which this
    model loops in an array, a string or a number until ``max_tokens``: every answer is closed in time, and
    so parses and validates, with ``finish_reason: "stop"`` (bench/structured_outputs.py measures the same
    workload against other servers)."""
    from bench.structured_outputs import SCHEMAS as OPEN_SCHEMAS
    from bench.structured_outputs import TOOLS as OPEN_TOOLS

    url = f"{live_server.base_url}/v1/chat/completions"
    bodies = []
    for i, (name, schema) in enumerate(sorted(OPEN_SCHEMAS.items())):
        for temperature in (0.0, 0.8):
            fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
            content = f"Describe a {name} as JSON. Give a realistic example as a JSON object."
            bodies.append(
                {
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": 72 + 8 * i,
                    "temperature": temperature,
                    "seed": i,
                    "response_format": fmt,
                }
            )
    tool_chat = [{"role": "user", "content": "Find me a flight to Tokyo from London on 2026-03-01."}]
    bodies.append(
        {
            "messages": tool_chat,
            "max_tokens": 40,
            "temperature": 0,
            "tools": OPEN_TOOLS,
            "tool_choice": "required",
        }
    )

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers=live_server.headers, timeout=300) as http:
            return list(await asyncio.gather(*(http.post(url, json=b) for b in bodies)))

    for body, resp in zip(bodies, asyncio.run(run()), strict=True):
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "tool_calls"), choice
        if "response_format" in body:
            schema = body["response_format"]["json_schema"]["schema"]
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        else:
            call = choice["message"]["tool_calls"][0]["function"]
            params = {t["function"]["name"]: t["function"]["parameters"] for t in OPEN_TOOLS}
            jsonschema.validate(json.loads(call["arguments"]), params[call["name"]])


def _mixed_request(i: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"Tell me about item {i}."}],
        "max_tokens": 24,
        "temperature": 0.8,
        "seed": 100 + i,
    }
    if i % 2 == 0:
        body["response_format"] = _schema_format(SCHEMAS[sorted(SCHEMAS)[i % len(SCHEMAS)]])
    return body


def test_16_concurrent_mixed_requests_equal_their_runs_alone(live_server: LiveServer) -> None:
    url = f"{live_server.base_url}/v1/chat/completions"

    async def run(bodies: list[dict[str, Any]]) -> list[str]:
        async with httpx.AsyncClient(headers=live_server.headers, timeout=300) as http:
            responses = await asyncio.gather(*(http.post(url, json=b) for b in bodies))
        for r in responses:
            assert r.status_code == 200, r.text
        return [r.json()["choices"][0]["message"]["content"] for r in responses]

    bodies = [_mixed_request(i) for i in range(16)]
    together = asyncio.run(run(bodies))
    alone = [asyncio.run(run([b]))[0] for b in bodies]
    assert together == alone


def _forced(client: openai.OpenAI, model: str, stream: bool, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=model,
        messages=TOOL_CHAT,
        tools=[WEATHER_TOOL, TIME_TOOL],
        max_tokens=80,
        stream=stream,
        **kwargs,
    )


def _check_call(name: str, arguments: str) -> None:
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[name]
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_tool_call_validates(live_server: LiveServer, client: openai.OpenAI, tool_choice: Any) -> None:
    resp = _forced(client, live_server.model, False, tool_choice=tool_choice, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert calls
    for call in calls:
        assert call.id.startswith("call_")
        assert call.type == "function"
        _check_call(call.function.name, call.function.arguments)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == ["get_weather"]


def test_streamed_tool_call_reassembles_to_the_message(
    live_server: LiveServer, client: openai.OpenAI
) -> None:
    kwargs: dict[str, Any] = {"tool_choice": "required", "temperature": 0, "parallel_tool_calls": False}
    full = _forced(client, live_server.model, False, **kwargs).choices[0]
    calls: dict[int, dict[str, str]] = {}
    reason = None
    for chunk in _forced(client, live_server.model, True, **kwargs):
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                if delta.id:
                    call["id"] = delta.id
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    assert reason == full.finish_reason == "tool_calls"
    expected = [(c.function.name, c.function.arguments) for c in full.message.tool_calls or []]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert len(expected) == 1
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_tool_round_trip_messages_are_accepted(live_server: LiveServer, client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        *TOOL_CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]
    resp = client.chat.completions.create(
        model=live_server.model, messages=messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=10
    )
    assert resp.choices[0].message.content is not None


BAD_INPUTS: list[tuple[str, dict[str, Any], str]] = [
    (
        "schema_missing",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
    ),
    ("schema_invalid", {"response_format": _schema_format({"type": "frobnicate"})}, "response_format"),
    ("regex_invalid", {"guided_regex": "a(b"}, "guided_regex"),
    ("grammar_invalid", {"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ("two_constraints", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("tool_choice_without_tools", {"tool_choice": "required"}, "tool_choice"),
    (
        "named_tool_unknown",
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    (
        "auto_tools_with_a_response_format",
        {"tools": [WEATHER_TOOL], "response_format": {"type": "json_object"}},
        "response_format",
    ),
]


@pytest.mark.parametrize(
    ("body", "param"), [(b, p) for _, b, p in BAD_INPUTS], ids=[n for n, _, _ in BAD_INPUTS]
)
def test_bad_inputs_are_400_naming_the_field(
    live_server: LiveServer, body: dict[str, Any], param: str
) -> None:
    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    r = httpx.post(f"{live_server.base_url}/v1/chat/completions", json=payload, headers=live_server.headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param), error
    assert param.split(".")[0] in error["message"]


def test_cancelled_constrained_request_leaves_the_engine_clean(live_server: LiveServer) -> None:
    url = f"{live_server.base_url}/v1/chat/completions"
    body = {**_mixed_request(0), "max_tokens": 200, "stream": True}

    async def cancel_midway() -> None:
        async with httpx.AsyncClient(headers=live_server.headers, timeout=120) as http:
            async with http.stream("POST", url, json=body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_lines():
                    break  # leave after the first event: the server cancels the request

    asyncio.run(cancel_midway())
    manager = live_server.state.manager
    assert manager is not None
    # NOTE: the role chunk comes before the engine has seen the request: wait for the cancel to land.
    assert wait_until(lambda: not manager.loop.outputs.groups, timeout=60)
    assert live_server.wait_idle()
    manager.check_integrity()
