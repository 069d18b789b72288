"""Tool calls in Mistral's syntax (vLLM's ``mistral`` parser). ``[TOOL_CALLS]`` (a special token: the output
is decoded with special tokens for this syntax) opens the calls, in one of two shapes:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]   (v0.3 templates)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}              (v11+ templates)

Same contract as the Hermes scanner (server/tool_parser.py): ``undecided`` while the output could still
open a call, names first, arguments as generated (they only grow), ``content`` for anything else. Mistral's
templates require call ids of 9 letters and digits (``new_call_id``).
"""

from __future__ import annotations

import re
import secrets
import string

from server.tool_parser import Scan, ScannedCall, scan_call

TOOL_CALLS = "[TOOL_CALLS]"
_JSON_HEAD = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_JSON_TAIL = re.compile(r"\s*\}")
_ARGS_HEAD = re.compile(r"\s*(?:\[TOOL_CALLS\])?\s*([A-Za-z0-9_.\-]+)\[ARGS\]")
_NO_TAIL = re.compile("")
_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A call id as Mistral's templates require it: 9 letters and digits."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def scan(text: str, finished: bool) -> Scan:
    """The calls in ``text``; a finished output that never opened a call is ``content``."""
    rest = text.lstrip()
    if len(rest) < len(TOOL_CALLS) and TOOL_CALLS.startswith(rest):
        return Scan("content" if finished else "undecided")
    if not rest.startswith(TOOL_CALLS):
        return Scan("content")
    pos = len(text) - len(rest) + len(TOOL_CALLS)
    after = text[pos:].lstrip()
    if not after or after.startswith("["):
        return Scan("calls", _scan_all(text, pos, _JSON_HEAD, _JSON_TAIL))
    return Scan("calls", _scan_all(text, pos, _ARGS_HEAD, _NO_TAIL))


def _scan_all(text: str, pos: int, head: re.Pattern[str], tail: re.Pattern[str]) -> tuple[ScannedCall, ...]:
    calls: list[ScannedCall] = []
    while True:
        call, pos = scan_call(text, pos, head, tail)
        if call is not None:
            calls.append(call)
        if call is None or not call.complete:
            return tuple(calls)
