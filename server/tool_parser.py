"""Tool calls in Hermes syntax (Qwen2/Qwen3's, and the generic format of ``tool_choice: "auto"``):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, blocks separated by whitespace, opening the output. ``scan(text)`` reads an output
so far, finished or not: still ``undecided`` while it could yet open a call (whitespace, a prefix of
``<tool_call>``), else ``content`` or ``calls``. A call's ``arguments`` is the arguments value exactly as
generated, so that it only grows as the output grows: the streamed fragments (the text it gained since
the previous scan) add up to the finished message's arguments by construction.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# NOTE: the name comes first (the generic grammar puts it there, Qwen's template asks for it), so a
# call's name is known before its arguments are generated and streams first.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_CALL_TAIL = re.compile(r"\s*\}\s*" + re.escape(CALL_CLOSE))
_DECODER = json.JSONDecoder()

ScanMode = Literal["undecided", "content", "calls"]


@dataclass(frozen=True)
class ScannedCall:
    """One call: its ``arguments`` so far (the whole value when ``complete``, its closing tag read)."""

    name: str
    arguments: str
    complete: bool


@dataclass(frozen=True)
class Scan:
    """What an output is so far: its calls when ``mode`` is ``calls``."""

    mode: ScanMode
    calls: tuple[ScannedCall, ...] = ()

    @property
    def all_complete(self) -> bool:
        return self.mode == "calls" and bool(self.calls) and all(c.complete for c in self.calls)


def _could_open(rest: str) -> bool:
    """``rest`` (no leading whitespace) is empty or a proper prefix of the opening tag."""
    return len(rest) < len(CALL_OPEN) and CALL_OPEN.startswith(rest)


def scan(text: str, finished: bool) -> Scan:
    """The calls in ``text``; a finished output that never opened a call is ``content``."""
    rest = text.lstrip()
    if _could_open(rest):
        return Scan("content" if finished else "undecided")
    if not rest.startswith(CALL_OPEN):
        return Scan("content")
    calls: list[ScannedCall] = []
    pos = len(text) - len(rest)
    while True:
        call, pos = scan_call(text, pos + len(CALL_OPEN), _CALL_HEAD, _CALL_TAIL)
        if call is not None:
            calls.append(call)
        if call is None or not call.complete:
            break
        rest = text[pos:].lstrip()
        if not rest.startswith(CALL_OPEN):
            break
        pos = len(text) - len(rest)
    return Scan("calls", tuple(calls))


def scan_call(
    text: str, pos: int, head_re: re.Pattern[str], tail_re: re.Pattern[str]
) -> tuple[ScannedCall | None, int]:
    """The call whose head (``head_re``: group 1 the name, a JSON string or a bare word; it ends where the
    arguments value starts) matches at ``pos`` (None while its name is unknown), and where it ends: after
    ``tail_re`` once complete. Shared by every syntax's scanner (server/tool_syntax.py)."""
    head = head_re.match(text, pos)
    if head is None:
        return None, len(text)
    raw_name = head.group(1)
    name = json.loads(raw_name) if raw_name.startswith('"') else raw_name
    start = head.end()
    try:
        _, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        # NOTE: an unfinished value: all the text after its start belongs to it so far.
        return ScannedCall(name, text[start:], complete=False), len(text)
    tail = tail_re.match(text, end)
    complete = tail is not None
    return ScannedCall(name, text[start:end], complete), tail.end() if tail else len(text)
