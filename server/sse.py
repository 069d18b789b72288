"""Server-sent events as OpenAI streams them: ``data: <json>\\n\\n`` per chunk, ``data: [DONE]\\n\\n`` last.

``EventStreamResponse`` runs a cleanup callback however the stream ends (finished, client gone, server
shutdown), even when the body generator never started: that is where a stream's engine requests are
cancelled and its in-flight count released.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE_EVENT = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    # NOTE: tells nginx-style proxies not to buffer the stream (tokens must reach the client as made).
    "X-Accel-Buffering": "no",
}


def sse_event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event holding ``payload`` as compact JSON (one line: JSON escapes newlines)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response over an async generator of encoded events."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                aclose = getattr(self._events, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self._on_close()
