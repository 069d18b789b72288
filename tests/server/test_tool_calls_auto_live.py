"""``tool_choice: "auto"`` through HTTP on the real default model (SmolLM2, whose template knows no tools:
the generic format): every answer is either a reply or calls that validate, streamed deltas reassemble
to the non-streamed message, and a call -> tool result -> answer round trip."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from server_fixtures import LiveServer

pytestmark = pytest.mark.slow

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
        "description": "The current time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
# NOTE: one worked example (a call, its result, the answer) before the question: a 135M model follows it and
# calls, so that the call path is taken deterministically (unprompted it answers in words).
EXAMPLE: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather in Rome?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "21 degrees and cloudy"},
    {"role": "assistant", "content": "It is 21 degrees and cloudy in Rome."},
]
WEATHER_CHAT: list[ChatCompletionMessageParam] = [
    *EXAMPLE,
    {"role": "user", "content": "What is the weather in Paris?"},
]
PROMPTS = ["What is the weather in Paris?", "What time is it in Tokyo?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{live_server.base_url}/v1", api_key=live_server.api_key, max_retries=0, timeout=180
    )


def _create(client: openai.OpenAI, model: str, messages: Any, stream: bool = False, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=80, stream=stream, **kwargs
    )


def _check(choice: Any) -> str:
    """The kind of a valid ``auto`` answer: ``call`` (every call validates) or ``reply``."""
    calls = choice.message.tool_calls
    if calls:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in calls:
            tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
            assert call.id.startswith("call_") and call.type == "function"
        return "call"
    assert choice.finish_reason in ("stop", "length")
    assert (
        isinstance(choice.message.content, str) and "<tool_call>" not in choice.message.content.lstrip()[:11]
    )
    return "reply"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_auto_answers_are_a_reply_or_valid_calls(
    live_server: LiveServer, client: openai.OpenAI, prompt: str, temperature: float
) -> None:
    messages = [{"role": "user", "content": prompt}]
    for tool_choice in ("auto", openai.omit):
        resp = _create(
            client, live_server.model, messages, temperature=temperature, seed=5, tool_choice=tool_choice
        )
        _check(resp.choices[0])


def test_the_weather_question_gets_a_call(live_server: LiveServer, client: openai.OpenAI) -> None:
    choice = _create(client, live_server.model, WEATHER_CHAT, temperature=0).choices[0]
    assert _check(choice) == "call", choice.message.content
    assert choice.message.tool_calls[0].function.name == "get_weather"


def _reassembled(chunks: Any) -> tuple[str | None, list[tuple[str, str]], str | None]:
    content: str | None = None
    calls: dict[int, dict[str, str]] = {}
    reason = None
    for chunk in chunks:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.id:
                    assert delta.id.startswith("call_") and delta.function.name
                    call["name"] = delta.function.name
                call["arguments"] += delta.function.arguments or ""
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], reason


@pytest.mark.parametrize(
    "messages", [WEATHER_CHAT, [{"role": "user", "content": PROMPTS[2]}]], ids=["call", "reply"]
)
def test_streamed_auto_answer_equals_the_message(
    live_server: LiveServer, client: openai.OpenAI, messages: list[ChatCompletionMessageParam]
) -> None:
    full = _create(client, live_server.model, messages, temperature=0).choices[0]
    content, calls, reason = _reassembled(
        _create(client, live_server.model, messages, stream=True, temperature=0)
    )
    expected = [(c.function.name, c.function.arguments) for c in full.message.tool_calls or []]
    assert (content, calls, reason) == (full.message.content, expected, full.finish_reason)


def test_parallel_tool_calls_false_allows_one_call(live_server: LiveServer, client: openai.OpenAI) -> None:
    messages = [*EXAMPLE, {"role": "user", "content": "Weather in Paris and in Oslo, and the time in Tokyo?"}]
    for seed in range(4):
        resp = _create(
            client, live_server.model, messages, temperature=1.0, seed=seed, parallel_tool_calls=False
        )
        _check(resp.choices[0])
        assert len(resp.choices[0].message.tool_calls or []) <= 1


def test_call_tool_result_answer_round_trip(live_server: LiveServer, client: openai.OpenAI) -> None:
    first = _create(client, live_server.model, WEATHER_CHAT, temperature=0).choices[0]
    assert _check(first) == "call"
    call = first.message.tool_calls[0]
    messages: list[ChatCompletionMessageParam] = [
        *WEATHER_CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    answer = _create(client, live_server.model, messages, temperature=0).choices[0]
    _check(answer)
    final = _create(client, live_server.model, messages, temperature=0, tool_choice="none").choices[0]
    assert final.finish_reason in ("stop", "length") and final.message.content
