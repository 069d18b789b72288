"""API-key authentication (``Authorization: Bearer <key>``), as OpenAI clients send it.

Pure ASGI middleware: it answers 401 before the body is read. /health, /metrics, /version and the
OpenAPI docs stay open (probes and scrapers carry no key); CORS preflights (OPTIONS) are answered by the
CORS middleware outside this one.
"""

from __future__ import annotations

import hmac

from server.middleware.asgi import ASGIApp, Receive, Scope, Send, header, send_error

OPEN_PATHS = frozenset(
    {"/health", "/metrics", "/version", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
)


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must be a non-empty string")
        self.app = app
        self._key = api_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        value = header(scope, b"authorization")
        if value is None:
            return False
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer":
            return False
        # NOTE: compare_digest takes time independent of where the strings differ (no timing oracle).
        return hmac.compare_digest(token.strip().encode("latin-1"), self._key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await send_error(
                send,
                401,
                "invalid or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                extra_headers=[(b"www-authenticate", b"Bearer")],
            )
            return
        await self.app(scope, receive, send)
