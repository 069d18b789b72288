"""The FastAPI application: routes, error bodies and the middleware stack.

Middlewares, outermost first (each sees what the inner ones answer):
  HTTP metrics -> X-Request-Id -> CORS (when origins are given) -> API key -> body size limit
  -> unexpected exceptions (500) -> routes.
All are pure ASGI (no ``BaseHTTPMiddleware``), so SSE streams and client disconnects pass through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from server import (
    serving_chat,
    serving_completions,
    serving_info,
    serving_tokenize,
    serving_watermark,
    serving_worker,
)
from server.config import ServerConfig
from server.errors import install_error_handlers
from server.lifecycle import ServerState, lifespan
from server.metrics import HTTPMetricsMiddleware, Metrics
from server.middleware.auth import APIKeyMiddleware
from server.middleware.body_limit import BodySizeLimitMiddleware
from server.middleware.request_id import RequestIdMiddleware
from server.middleware.unexpected_errors import UnexpectedErrorMiddleware
from server.openapi import publish_standard_bounds
from server.serving_info import server_version

if TYPE_CHECKING:
    from engine.engine import Engine


def build_app(engine: Engine, config: ServerConfig, metrics: Metrics | None = None) -> FastAPI:
    """The app serving ``engine``; its lifespan starts the engine loop and stops it at shutdown.
    ``app.state.server`` is the ``ServerState`` (tests read the manager's stats through it)."""
    if metrics is None:
        metrics = Metrics(
            config.served_model_name, engine.block_size, engine.num_blocks, max_model_len=engine.max_model_len
        )
    app = FastAPI(
        title="cbserve",
        version=server_version(),
        description="A continuous-batching LLM server with an OpenAI-compatible API.",
        lifespan=lifespan,
    )
    app.state.server = ServerState(engine, config, metrics)
    install_error_handlers(app)
    for module in (
        serving_completions,
        serving_chat,
        serving_tokenize,
        serving_watermark,
        serving_info,
        serving_worker,
    ):
        app.include_router(module.router)
    publish_standard_bounds(app)
    # NOTE: add_middleware wraps what is there: the last added runs first (outermost).
    app.add_middleware(UnexpectedErrorMiddleware)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=config.max_body_bytes)
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
    return app
