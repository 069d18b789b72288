"""The tool-call syntaxes of ``tool_choice: "auto"`` (server/tool_syntax.py) on scripted outputs: Llama 3's
JSON and Mistral's ``[TOOL_CALLS]`` beside Hermes — a reply or calls, every cut point of a stream scanning
monotonically, streamed deltas reassembling to the message, and which syntax a chat template asks for."""

from __future__ import annotations

import json
from typing import Any

import pytest

from server.tool_parser import Scan
from server.tool_parser_mistral import new_call_id as mistral_call_id
from server.tool_stream import ToolCallStreamer
from server.tool_syntax import SYNTAXES, tool_syntax

CALLS = [
    ("get_weather", {"city": "Paris }; [ARGS]", "unit": "celsius"}),
    ("get_time", {"tz": "UTC", "n": [1, {"a": 2}]}),
]


def _args(value: dict[str, Any]) -> str:
    return json.dumps(value)


OUTPUTS: dict[str, str] = {
    "hermes": "\n".join(
        f'<tool_call>\n{{"name": "{n}", "arguments": {_args(a)}}}\n</tool_call>' for n, a in CALLS
    ),
    "llama3_json": "; ".join(f'{{"name": "{n}", "parameters": {_args(a)}}}' for n, a in CALLS),
    "mistral": "[TOOL_CALLS] ["
    + ", ".join(f'{{"name": "{n}", "arguments": {_args(a)}}}' for n, a in CALLS)
    + "]",
}
MORE_OUTPUTS = {
    "llama3_json": '<|python_tag|>{"name": "get_weather", "arguments": ' + _args(CALLS[0][1]) + "}",
    "mistral": "".join(f"[TOOL_CALLS]{n}[ARGS]{_args(a)}" for n, a in CALLS),
}
REPLIES = ["Hello there, I am fine.", "{ this is not a call", "[not a call]", "  \n The answer is 4."]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_calls_are_read_with_names_and_arguments(name: str) -> None:
    scanned = SYNTAXES[name].scan(OUTPUTS[name], True)
    assert scanned.mode == "calls" and scanned.all_complete
    assert [(c.name, json.loads(c.arguments)) for c in scanned.calls] == CALLS


@pytest.mark.parametrize("name", sorted(MORE_OUTPUTS))
def test_the_other_shapes_of_a_syntax(name: str) -> None:
    scanned = SYNTAXES[name].scan(MORE_OUTPUTS[name], True)
    expected = CALLS[:1] if name == "llama3_json" else CALLS
    assert scanned.all_complete and [(c.name, json.loads(c.arguments)) for c in scanned.calls] == expected


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("reply", REPLIES)
def test_a_reply_is_content(name: str, reply: str) -> None:
    assert SYNTAXES[name].scan(reply, True) == Scan("content")


@pytest.mark.parametrize("name", sorted(OUTPUTS) + [f"{n}+" for n in sorted(MORE_OUTPUTS)])
def test_every_cut_point_scans_monotonically(name: str) -> None:
    syntax = SYNTAXES[name.rstrip("+")]
    text = MORE_OUTPUTS[name.rstrip("+")] if name.endswith("+") else OUTPUTS[name]
    previous = Scan("undecided")
    for cut in range(len(text) + 1):
        scanned = syntax.scan(text[:cut], False)
        assert scanned.mode != "content", f"{text[:cut]!r} read as content"
        if previous.mode == "calls":
            assert scanned.mode == "calls" and len(scanned.calls) >= len(previous.calls)
            for old, new in zip(previous.calls, scanned.calls, strict=False):
                assert new.name == old.name and new.arguments.startswith(old.arguments)
        previous = scanned
    assert previous.all_complete


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("step", [1, 3, 11, 10_000])
def test_streamed_deltas_reassemble_to_the_calls(name: str, step: int) -> None:
    streamer = ToolCallStreamer(SYNTAXES[name])
    text = OUTPUTS[name]
    deltas: list[dict[str, Any]] = []
    for cut in [*range(step, len(text), step), len(text)]:
        deltas += streamer.deltas(text[:cut], cut == len(text))
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        assert "content" not in delta
        for part in delta["tool_calls"]:
            call = calls.setdefault(part["index"], {"name": "", "arguments": "", "id": ""})
            call["id"] += part.get("id", "")
            call["name"] += part.get("function", {}).get("name", "")
            call["arguments"] += part["function"].get("arguments", "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == CALLS
    if name == "mistral":
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls.values())


def test_a_streamed_reply_is_held_only_while_it_could_open_a_call() -> None:
    for name, prefix in [
        ("llama3_json", '{"na'),
        ("llama3_json", '{"name": "get_wea'),
        ("mistral", " [TOOL_"),
    ]:
        assert SYNTAXES[name].scan(prefix, False) == Scan("undecided")
        assert SYNTAXES[name].scan(prefix, True) == Scan("content")
    assert ToolCallStreamer(SYNTAXES["llama3_json"]).deltas("Sure! {", False) == [{"content": "Sure! {"}]


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ tools }} <tool_call> {{ messages }}", "hermes"),
        (
            '{{ tools }} Respond in the format {"name": function name, "parameters": dictionary of argument name',
            "llama3_json",
        ),
        ("{{ tools }} <|python_tag|>{{ messages }}", "llama3_json"),
        ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS] [TOOL_CALLS]", "mistral"),
        ("{{ messages }}", "hermes"),
        (None, "hermes"),
    ],
)
def test_the_syntax_comes_from_the_chat_template_or_the_flag(template: str | None, expected: str) -> None:
    assert tool_syntax("auto", template).name == expected
    assert tool_syntax("mistral", template).name == "mistral"
    assert tool_syntax("llama3_json", template).name == "llama3_json"


def test_mistral_call_ids_are_nine_letters_and_digits() -> None:
    ids = {mistral_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)
