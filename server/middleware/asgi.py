"""ASGI types and a helper to answer with an OpenAI error body before FastAPI runs (for the pure ASGI
middlewares: auth, body size, request id)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from server.errors import error_bytes

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of request header ``name`` (lower case), decoded as latin-1."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


async def send_error(
    send: Send,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = error_bytes(status, message, param, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})
