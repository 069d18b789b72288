"""Request body size limit: 413 when ``Content-Length`` or the bytes actually received exceed it.

Pure ASGI middleware that reads the whole body first (every route takes one JSON document, which FastAPI
would read whole anyway), then replays it to the app. Checking here rather than while FastAPI reads is
what makes the answer a 413: FastAPI turns any exception raised while it reads into a generic 400.
"""

from __future__ import annotations

from server.middleware.asgi import ASGIApp, Message, Receive, Scope, Send, header, send_error


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def _reject(self, send: Send, size: str) -> None:
        await send_error(
            send,
            413,
            f"request body of {size} bytes exceeds the limit of {self.max_body_bytes} bytes",
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = header(scope, b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await send_error(
                    send, 400, f"invalid Content-Length header {declared!r}", code="invalid_header"
                )
                return
            if int(declared) > self.max_body_bytes:
                await self._reject(send, declared.strip())
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # NOTE: the client left before sending its request: nobody to answer.
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await self._reject(send, f"more than {self.max_body_bytes}")
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            # NOTE: after the body, receive() is how the app learns of a disconnect: pass it through.
            return await receive()

        await self.app(scope, replay, send)
