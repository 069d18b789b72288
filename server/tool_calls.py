"""Tool calls: ``tools`` with ``tool_choice`` ``"required"``, a named function, or ``"auto"``.

Forced calls are constrained (a JSON schema, engine/generation/grammar.py) so that the output always
parses into calls whose arguments validate against the function's ``parameters``:

- a named function: the output is its arguments object;
- ``required``: a JSON array of ``{"name", "arguments"}`` objects, one of the tools each (one call at
  most with ``parallel_tool_calls: false``).

``"auto"`` (also the default when ``tools`` come without ``tool_choice``): the model chooses between a
reply and calls in Hermes syntax (server/tool_parser.py). A chat template that knows tools (Qwen's)
asks for that syntax itself and its output is only parsed; one that knows none (SmolLM2's) gets the
tools and the syntax described in a system message, and the output is constrained to either a reply or
calls whose arguments validate (``auto_tool_spec``), as llama.cpp's server does. ``"none"`` leaves the
output free.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from engine.generation.grammar_spec import GrammarSpec
from server.errors import APIError
from server.schemas import ChatCompletionRequest, ResponseFunctionCall, ResponseToolCall, ToolDefinition
from server.tool_parser import CALL_CLOSE, CALL_OPEN, Scan

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
    if not tools or choice is None or choice == "none" or choice == "auto":
        return []
    if choice == "required":
        return list(tools)
    named = [t for t in tools if t.function.name == choice.function.name]
    if not named:
        raise _bad("tool_choice", f"names the function {choice.function.name!r}, which is not in tools")
    return named[:1]


def auto_tools(body: ChatCompletionRequest) -> list[ToolDefinition]:
    """The tools the model may call or not (``tool_choice`` ``"auto"`` or omitted); empty otherwise."""
    return list(body.tools or []) if body.tool_choice in (None, "auto") else []


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


def _call_schema(tool: ToolDefinition) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": _parameters(tool)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def auto_tool_spec(body: ChatCompletionRequest, tools: list[ToolDefinition]) -> GrammarSpec:
    """The grammar of an ``auto`` output: a reply that does not open a call, or one call (several with
    ``parallel_tool_calls`` not false) in Hermes syntax whose JSON validates (llguidance's Lark, %json)."""
    call_json = json.dumps({"anyOf": [_call_schema(t) for t in tools]}, ensure_ascii=False)
    calls = 'call ("\\n" call)*' if body.parallel_tool_calls is not False else "call"
    lark = "\n".join(
        [
            "start: REPLY | calls",
            # NOTE: a reply is anything but what opens a call, so the parse of an output is never ambiguous.
            f"REPLY: /(?s:.+)/ & ~/(?s:[ \\t\\n]*{re.escape(CALL_OPEN)}.*)/",
            f"calls: {calls}",
            f'call: "{CALL_OPEN}\\n" call_json "\\n{CALL_CLOSE}"',
            f"call_json: %json {call_json}",
        ]
    )
    return GrammarSpec.grammar(lark, "tools")


def scanned_tool_calls(scanned: Scan, call_id: Callable[[], str]) -> list[ResponseToolCall]:
    """The response's calls of a scanned ``auto`` output, with new ids from ``call_id``."""
    return [
        ResponseToolCall(id=call_id(), function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
        for c in scanned.calls
    ]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


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
            id=new_call_id(),
            function=ResponseFunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)),
        )
        for name, arguments in pairs
    ]


def tools_system_prompt(tools: list[ToolDefinition], auto: bool) -> str:
    """The tools described in a system message, for chat templates that know no ``tools`` (llama.cpp's
    generic format); with ``auto``, how to call them (Hermes syntax) or answer in words instead."""
    described = [
        {"name": t.function.name, "description": t.function.description or "", "parameters": _parameters(t)}
        for t in tools
    ]
    how = (
        f"\nTo call a function, answer only with {CALL_OPEN}\n"
        + '{"name": <function name>, "arguments": <arguments object>}'
        + f"\n{CALL_CLOSE}\nOtherwise answer in words."
        if auto
        else "\nTo call functions, answer with their names and arguments as JSON."
    )
    return (
        "You can call these functions. Each one's arguments follow its JSON Schema:\n"
        + json.dumps(described, ensure_ascii=False, indent=2)
        + how
    )
