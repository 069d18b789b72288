"""Which tool-call syntax a model writes for ``tool_choice: "auto"``, chosen once per server from its chat
template (or ``--tool-call-parser``), as vLLM's tool parsers are:

- ``hermes``: ``<tool_call>{"name", "arguments"}</tool_call>`` (Qwen2/Qwen3, Hermes; and cbserve's generic
  format for templates that know no tools): server/tool_parser.py;
- ``llama3_json``: ``{"name", "parameters"}`` objects, ``;``-separated (Llama 3.1+): server/tool_parser_llama3.py;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of calls, or ``name[ARGS]{...}`` (Mistral):
  server/tool_parser_mistral.py.

Each syntax's ``scan(text, finished) -> Scan`` has the same contract, so the message and the stream
(server/tool_stream.py) are built the same way whatever the syntax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from server import tool_parser, tool_parser_llama3, tool_parser_mistral
from server.tool_calls import new_call_id
from server.tool_parser import Scan


@dataclass(frozen=True)
class ToolSyntax:
    """``keep_special_tokens``: the syntax's markers are special tokens, so its outputs are decoded with
    them. ``new_call_id``: the ids its templates accept for earlier calls."""

    name: str
    scan: Callable[[str, bool], Scan]
    keep_special_tokens: bool = False
    new_call_id: Callable[[], str] = new_call_id


SYNTAXES = {
    "hermes": ToolSyntax("hermes", tool_parser.scan),
    "llama3_json": ToolSyntax("llama3_json", tool_parser_llama3.scan),
    "mistral": ToolSyntax("mistral", tool_parser_mistral.scan, True, tool_parser_mistral.new_call_id),
}


def tool_syntax(parser: str, chat_template: str | None) -> ToolSyntax:
    """The syntax ``parser`` names, or with ``auto`` the one ``chat_template`` asks for (Hermes when it names
    none: cbserve's generic format for templates that know no tools is Hermes too)."""
    if parser != "auto":
        return SYNTAXES[parser]
    template = chat_template or ""
    if tool_parser_mistral.TOOL_CALLS in template:
        return SYNTAXES["mistral"]
    if tool_parser.CALL_OPEN in template:
        return SYNTAXES["hermes"]
    if tool_parser_llama3.PYTHON_TAG in template or '"parameters": dictionary' in template:
        return SYNTAXES["llama3_json"]
    return SYNTAXES["hermes"]
