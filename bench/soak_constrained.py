"""The soak's constrained scenarios (bench/soak.py): JSON-schema, regex and tool-call requests, streamed
and not, some cancelled, and the check that an answer obeys its constraint.

An uncancelled constrained answer must finish (``stop``, or ``tool_calls`` for a forced call) and match:
its JSON parses and validates against the schema, its text matches the regex whole, each tool call names
one of the tools and its arguments validate against that tool's parameters. Streams are reassembled
from their deltas (content, and tool calls by ``index``) before the same check.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
CODE_REGEX = r"[A-Z]{3}-[0-9]{4}"
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "The sum of two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

CONSTRAINED_SCENARIOS: dict[str, float] = {  # scenario -> weight
    "json-schema-stream": 1,
    "regex": 1,
    "tool-call": 1,
    "tool-call-stream": 1,
    "cancel-constrained-stream": 1,
}


def constrained_request(rng: random.Random, scenario: str) -> tuple[str, dict[str, Any]]:
    """(path, body) of one constrained request of ``scenario`` (``ignore_eos`` cannot combine with a
    grammar: the output ends when its constraint is complete)."""
    common: dict[str, Any] = {"temperature": rng.choice([0, 0.8]), "seed": rng.randrange(2**31)}
    who = rng.choice(["a baker", "a pilot", "a poet", "a farmer"])
    if scenario in ("json-schema-stream", "cancel-constrained-stream"):
        schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
        messages = [{"role": "user", "content": f"Describe {who} as JSON."}]
        body = {**common, "messages": messages, "response_format": schema_format, "max_tokens": 64}
        return "/v1/chat/completions", {**body, "stream": True}
    if scenario == "regex":
        prompt = f"The product code of {who}'s order is"
        return "/v1/completions", {**common, "prompt": prompt, "guided_regex": CODE_REGEX, "max_tokens": 16}
    if scenario in ("tool-call", "tool-call-stream"):
        ask = rng.choice(
            ["What is the weather in Paris?", f"Add {rng.randint(1, 99)} and {rng.randint(1, 99)}."]
        )
        body = {**common, "messages": [{"role": "user", "content": ask}], "max_tokens": 64}
        body |= {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
        return "/v1/chat/completions", {**body, "stream": scenario == "tool-call-stream"}
    raise ValueError(f"unknown constrained scenario {scenario!r}")


def check_answer(body: dict[str, Any], answer: dict[str, Any]) -> str | None:
    """What is wrong with a non-streamed answer to a constrained ``body`` (None: nothing)."""
    choice = answer["choices"][0]
    if "message" in choice:
        message = choice["message"]
        return check_output(
            body, message.get("content"), message.get("tool_calls") or [], choice["finish_reason"]
        )
    return check_output(body, choice["text"], [], choice["finish_reason"])


def check_stream(body: dict[str, Any], chunks: list[dict[str, Any]]) -> str | None:
    """What is wrong with a whole streamed chat answer to a constrained ``body`` (None: nothing)."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            content.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                merged = calls.setdefault(call["index"], {"function": {"name": "", "arguments": ""}})
                function = call.get("function") or {}
                merged["function"]["name"] += function.get("name") or ""
                merged["function"]["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return check_output(body, "".join(content), [calls[i] for i in sorted(calls)], finish)


def check_output(
    body: dict[str, Any], text: str | None, tool_calls: list[dict[str, Any]], finish: str | None
) -> str | None:
    if "tools" in body:
        if finish != "tool_calls" or not tool_calls:
            return f"finish_reason {finish!r} with {len(tool_calls)} tool calls, expected tool_calls"
        return next(filter(None, (_check_call(c["function"]) for c in tool_calls)), None)
    if finish != "stop":
        return f"finish_reason {finish!r}, expected stop"
    if "guided_regex" in body:
        return (
            None if re.fullmatch(body["guided_regex"], text or "") else f"{text!r} does not match the regex"
        )
    try:
        jsonschema.validate(json.loads(text or ""), body["response_format"]["json_schema"]["schema"])
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"the JSON output is invalid: {str(exc).splitlines()[0]}"
    return None


def _check_call(function: dict[str, Any]) -> str | None:
    parameters = PARAMETERS.get(function["name"])
    if parameters is None:
        return f"a call to {function['name']!r}, which is not a tool"
    try:
        jsonschema.validate(json.loads(function["arguments"]), parameters)
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"invalid arguments for {function['name']}: {str(exc).splitlines()[0]}"
    return None
