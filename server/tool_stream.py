"""Streamed ``tool_choice: "auto"`` output as OpenAI's deltas, one ``ToolCallStreamer`` per choice.

Content is held back while the output could still open a call (server/tool_parser.py); then either
content deltas, or per call a first delta with its ``index``, ``id``, ``type`` and ``function.name``
(``arguments: ""``) followed by its argument fragments as they are generated. Each scan's arguments extend
the previous one's, so the fragments concatenate to the finished message's arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from server.tool_parser import Scan

if TYPE_CHECKING:
    from server.tool_syntax import ToolSyntax


class ToolCallStreamer:
    """The deltas of one choice's output in ``syntax``; ``scan`` is the last scan (the message's, once
    finished)."""

    def __init__(self, syntax: ToolSyntax) -> None:
        self.syntax = syntax
        self.scan = Scan("undecided")
        self._content_sent = 0
        self._ids: list[str] = []
        self._arguments_sent: list[int] = []

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas that bring the client from the previous ``text`` to this one."""
        self.scan = self.syntax.scan(text, finished)
        if self.scan.mode == "content":
            fresh = text[self._content_sent :]
            self._content_sent = len(text)
            return [{"content": fresh}] if fresh else []
        out: list[dict[str, Any]] = []
        for index, call in enumerate(self.scan.calls):
            if index == len(self._ids):
                self._ids.append(self.syntax.new_call_id())
                self._arguments_sent.append(0)
                head = {"index": index, "id": self._ids[index], "type": "function"}
                out.append({"tool_calls": [{**head, "function": {"name": call.name, "arguments": ""}}]})
            fresh = call.arguments[self._arguments_sent[index] :]
            if fresh:
                self._arguments_sent[index] = len(call.arguments)
                out.append({"tool_calls": [{"index": index, "function": {"arguments": fresh}}]})
        return out
