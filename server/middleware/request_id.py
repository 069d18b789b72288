"""``X-Request-Id``: the client's id (or a fresh one) names the request in the engine and in the logs,
and is echoed on every response, errors included."""

from __future__ import annotations

import re
import uuid

from server.middleware.asgi import ASGIApp, Message, Receive, Scope, Send, header, send_error

REQUEST_ID_HEADER = b"x-request-id"
# NOTE: ids end up in logs and in response ids: a bounded, printable alphabet keeps both safe.
_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_of(scope: Scope) -> str:
    """The request id the middleware stored for this request (a fresh one when it did not run)."""
    state = scope.get("state") or {}
    rid = state.get("request_id")
    return rid if isinstance(rid, str) else uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = header(scope, REQUEST_ID_HEADER)
        if given is not None and not _VALID_ID.match(given):
            await send_error(
                send,
                400,
                "invalid X-Request-Id header: 1 to 128 characters of A-Z a-z 0-9 . _ : -",
                param="X-Request-Id",
                code="invalid_header",
            )
            return
        rid = given or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        raw = rid.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                message["headers"] = [*headers, (REQUEST_ID_HEADER, raw)]
            await send(message)

        await self.app(scope, receive, send_with_id)
