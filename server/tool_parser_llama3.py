"""Tool calls in Llama 3.x's JSON syntax (vLLM's ``llama3_json`` parser): the output is one JSON object per
call, optionally after ``<|python_tag|>`` (a special token, so usually not in the decoded text), calls
separated by ``;``:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

Llama's templates ask for ``parameters``; ``arguments`` is read too. Same contract as the Hermes scanner
(server/tool_parser.py): ``undecided`` while the output could still open a call, names first, arguments as
generated (they only grow), ``content`` for anything else.
"""

from __future__ import annotations

import re

from server.tool_parser import Scan, ScannedCall, scan_call

PYTHON_TAG = "<|python_tag|>"
_NAME = r'("(?:[^"\\]|\\.)*")'
_HEAD = re.compile(
    r'\s*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*' + _NAME + r'\s*,\s*"(?:parameters|arguments)"\s*:\s*'
)
_TAIL = re.compile(r"\s*\}")
_SEPARATOR = re.compile(r"\s*;")
# NOTE: whitespace removed, an output that is a prefix of one of these may still open a call.
_OPENINGS = (PYTHON_TAG + '{"name":"', '{"name":"')


def _could_open(text: str) -> bool:
    squeezed = re.sub(r"\s+", "", text)
    return any(opening.startswith(squeezed) for opening in _OPENINGS)


def scan(text: str, finished: bool) -> Scan:
    """The calls in ``text``; a finished output that never opened a call is ``content``."""
    if _HEAD.match(text) is None:
        # NOTE: a head still being written ('{"na', '{"name": "get_wea') could yet open a call.
        if not finished and (_could_open(text) or _head_in_progress(text)):
            return Scan("undecided")
        return Scan("content")
    calls: list[ScannedCall] = []
    pos = 0
    while True:
        call, pos = scan_call(text, pos, _HEAD, _TAIL)
        if call is not None:
            calls.append(call)
        if call is None or not call.complete:
            break
        separator = _SEPARATOR.match(text, pos)
        if separator is None:
            break
        pos = separator.end()
    return Scan("calls", tuple(calls))


_NAME_SO_FAR = re.compile(r'\s*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*')
_AFTER_NAME = (',"parameters":', ',"arguments":')


def _head_in_progress(text: str) -> bool:
    """``text`` is a call's head cut short: the name, or the key after it, still being written."""
    match = _NAME_SO_FAR.match(text)
    if match is None:
        return False
    rest = text[match.end() :]
    if not rest:
        return True  # NOTE: the name itself is still being written
    squeezed = re.sub(r"\s+", "", rest[1:])  # after the name's closing quote
    return rest[0] == '"' and any(after.startswith(squeezed) for after in _AFTER_NAME)
