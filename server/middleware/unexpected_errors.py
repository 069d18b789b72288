"""The last line of defence: an exception no handler knows becomes a logged 500 with the OpenAI error
body. Done here rather than with an ``Exception`` handler, which Starlette runs in its outermost
middleware and then re-raises, so that uvicorn drops the keep-alive connection: a client's next request on
it would fail with a reset."""

from __future__ import annotations

import logging

from server.middleware.asgi import ASGIApp, Message, Receive, Scope, Send, send_error

logger = logging.getLogger(__name__)


class UnexpectedErrorMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as exc:
            logger.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # NOTE: half a response is out: only dropping the connection tells the client.
            await send_error(send, 500, f"internal server error: {type(exc).__name__}", code="internal_error")
