"""Forced tool calls: ``tools`` with ``tool_choice`` ``"required"`` or a named function.

Decoding is constrained (a JSON schema, engine/generation/grammar.py) so that the output always parses
into calls whose arguments validate against the function's ``parameters``:

- a named function: the output is its arguments object;
- ``required``: a JSON array of ``{"name", "arguments"}`` objects, one of the tools each (one call at
  most with ``parallel_tool_calls: false``).

``tool_choice: "none"`` leaves the output free. ``"auto"`` (the model choosing between a call and a
reply) is not supported yet: a 400 that says so, not a silent free-text answer.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from engine.generation.grammar_spec import GrammarSpec
from server.errors import APIError
from server.schemas import ChatCompletionRequest, ResponseFunctionCall, ResponseToolCall, ToolDefinition

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _bad(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", param=field, code="invalid_value")


def forced_tools(body: ChatCompletionRequest) -> list[ToolDefinition]:
    """The tools one of which the output must call (empty: no forced call); 400 for a ``tool_choice``
    that cannot work."""
    choice = body.tool_choice
    tools = body.tools or []
    if choice is not None and choice != "none" and not tools:
        raise _bad("tool_choice", "needs tools")
    if not tools or choice == "none":
        return []
    if choice is None or choice == "auto":
        raise _bad(
            "tool_choice",
            "'auto' (the default with tools) is not supported yet; use 'required', a named function or 'none'",
        )
    if choice == "required":
        return list(tools)
    named = [t for t in tools if t.function.name == choice.function.name]
    if not named:
        raise _bad("tool_choice", f"names the function {choice.function.name!r}, which is not in tools")
    return named[:1]


def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or ANY_OBJECT


def tool_call_spec(body: ChatCompletionRequest, tools: list[ToolDefinition]) -> GrammarSpec:
    """The grammar of a forced call to one of ``tools``."""
    if isinstance(body.tool_choice, str):
        call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in tools
            ]
        }
        schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return GrammarSpec.json_schema(schema, "tools")
    return GrammarSpec.json_schema(_parameters(tools[0]), "tools")


def parse_tool_calls(
    body: ChatCompletionRequest, tools: list[ToolDefinition], text: str
) -> list[ResponseToolCall]:
    """The calls in a forced-call output (complete, so it parses); ids are new ``call_...`` ids."""
    value = json.loads(text)
    if isinstance(body.tool_choice, str):
        pairs = [(c["name"], c["arguments"]) for c in value]
    else:
        pairs = [(tools[0].function.name, value)]
    return [
        ResponseToolCall(
            id=f"call_{uuid.uuid4().hex[:24]}",
            function=ResponseFunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)),
        )
        for name, arguments in pairs
    ]


def tools_system_prompt(tools: list[ToolDefinition]) -> str:
    """The tools described in a system message, for chat templates that know no ``tools`` (llama.cpp's
    generic format)."""
    described = [
        {"name": t.function.name, "description": t.function.description or "", "parameters": _parameters(t)}
        for t in tools
    ]
    return (
        "You can call these functions. Each one's arguments follow its JSON Schema:\n"
        + json.dumps(described, ensure_ascii=False, indent=2)
        + "\nTo call functions, answer with their names and arguments as JSON."
    )
