"""``tool_choice: "auto"`` without a model: the Hermes-syntax scanner (server/tool_parser.py), the streamed
deltas (server/tool_stream.py) reassembling to the finished message, the generic grammar on the default
model's tokenizer, and the prompt of a template that knows no tools."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.generation.grammar import GrammarCompiler
from engine.loader.tokenizer import Tokenizer
from server.prompts import chat_prompt
from server.schemas import ChatCompletionRequest, ToolDefinition
from server.tool_calls import auto_tool_spec, auto_tools, forced_tools
from server.tool_parser import Scan, ScannedCall, scan
from server.tool_stream import ToolCallStreamer
from server.tool_syntax import SYNTAXES

EOS = 2
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
WEATHER_TOOL = ToolDefinition.model_validate(WEATHER)
TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris } </tool_call>"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC", "n": [1, {"a": 2}]}}\n</tool_call>'
)


def _body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_scan_tells_a_reply_from_calls() -> None:
    assert scan("", finished=False) == Scan("undecided")
    assert scan(" \n<tool_c", finished=False) == Scan("undecided")
    assert scan(" \n<tool_c", finished=True) == Scan("content")
    assert scan("Hello <tool_call>", finished=False) == Scan("content")
    assert scan("<tool_call>\n", finished=False) == Scan("calls")
    two = scan(TWO_CALLS, finished=True)
    assert two.all_complete
    assert [(c.name, json.loads(c.arguments)) for c in two.calls] == [
        ("get_weather", {"city": "Paris } </tool_call>"}),
        ("get_time", {"tz": "UTC", "n": [1, {"a": 2}]}),
    ]


def test_an_unfinished_call_is_kept_incomplete() -> None:
    cut = scan(TWO_CALLS[:60], finished=True)
    assert cut.mode == "calls" and not cut.all_complete
    assert cut.calls == (ScannedCall("get_weather", TWO_CALLS[49:60], complete=False),)
    no_close = scan('<tool_call>\n{"name": "f", "arguments": {}}', finished=True)
    assert no_close.calls == (ScannedCall("f", "{}", complete=False),)


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_deltas_reassemble_to_the_message(step: int) -> None:
    streamer = ToolCallStreamer(SYNTAXES["hermes"])
    deltas: list[dict[str, Any]] = []
    for end in range(step, len(TWO_CALLS) + step, step):
        deltas += streamer.deltas(TWO_CALLS[:end], finished=end >= len(TWO_CALLS))
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        assert "content" not in delta
        (part,) = delta["tool_calls"]
        call = calls.setdefault(part["index"], {"name": "", "arguments": ""})
        if "id" in part:
            assert part["id"].startswith("call_") and part["type"] == "function"
            assert not call["name"], "the head comes once, first"
            call["name"] = part["function"]["name"]
        call["arguments"] += part["function"]["arguments"]
    message = scan(TWO_CALLS, finished=True)
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [
        (c.name, c.arguments) for c in message.calls
    ]


def test_a_streamed_reply_is_held_back_only_while_it_could_open_a_call() -> None:
    streamer = ToolCallStreamer(SYNTAXES["hermes"])
    assert streamer.deltas(" <tool", finished=False) == []
    assert streamer.deltas(" <tools are", finished=False) == [{"content": " <tools are"}]
    assert streamer.deltas(" <tools are nice", finished=True) == [{"content": " nice"}]
    assert ToolCallStreamer(SYNTAXES["hermes"]).deltas("\n", finished=True) == [{"content": "\n"}]


def test_auto_is_the_default_with_tools() -> None:
    assert auto_tools(_body(tools=[WEATHER])) and not forced_tools(_body(tools=[WEATHER]))
    assert auto_tools(_body(tools=[WEATHER], tool_choice="auto"))
    assert not auto_tools(_body(tools=[WEATHER], tool_choice="none"))
    assert not auto_tools(_body(tools=[WEATHER], tool_choice="required"))


@pytest.fixture(scope="module")
def compiler(smollm2_reader: Any) -> tuple[Tokenizer, GrammarCompiler]:
    tokenizer = Tokenizer.from_gguf(smollm2_reader)
    return tokenizer, GrammarCompiler(tokenizer, tokenizer.vocab_size, (EOS,))


def _accepts(compiler: tuple[Tokenizer, GrammarCompiler], spec: Any, text: str) -> bool:
    tokenizer, grammar = compiler
    matcher = grammar.compile(spec).matcher()
    for token in tokenizer.encode(text, add_special_tokens=False):
        try:
            matcher.accept_token(token)
        except RuntimeError:
            return False
    return matcher.is_accepting()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_the_generic_grammar_allows_a_reply_or_valid_calls(compiler: Any) -> None:
    spec = auto_tool_spec(_body(tools=[WEATHER]), [WEATHER_TOOL])
    assert _accepts(compiler, spec, "It is sunny, <tool_call> or not.")
    assert _accepts(compiler, spec, CALL)
    assert _accepts(compiler, spec, f"{CALL}\n{CALL}")
    assert not _accepts(compiler, spec, f"  {CALL}")
    assert not _accepts(compiler, spec, CALL.replace("get_weather", "get_time"))
    assert not _accepts(compiler, spec, CALL.replace('"Paris"', "3"))
    single = auto_tool_spec(_body(tools=[WEATHER], parallel_tool_calls=False), [WEATHER_TOOL])
    assert _accepts(compiler, single, CALL) and not _accepts(compiler, single, f"{CALL}\n{CALL}")


class RecordingTokenizer:
    """A chat template that knows no tools: it records the messages it renders."""

    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def __init__(self) -> None:
        self.rendered: list[dict[str, Any]] = []

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        self.rendered = messages
        return [1, 2, 3]


def test_earlier_calls_reach_a_template_without_tools_in_hermes_syntax() -> None:
    body = _body(
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        ],
        tools=[WEATHER],
    )
    tokenizer = RecordingTokenizer()
    assert chat_prompt(body.messages, tokenizer, 10, True, body.tools, auto_tools=True) == [1, 2, 3]
    system, _, call, result = tokenizer.rendered
    assert system["role"] == "system" and "<tool_call>" in system["content"]
    assert "get_weather" in system["content"]
    assert call == {"role": "assistant", "content": CALL}
    assert result == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    assert scan(call["content"], finished=True).all_complete
