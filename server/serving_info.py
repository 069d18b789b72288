"""The routes that describe the server: GET /v1/models, /v1/models/{id}, /health, /version, /metrics."""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from server.errors import APIError
from server.lifecycle import ServerState
from server.schemas import ERROR_RESPONSES, ModelCard, ModelList
from server.serving_common import check_model, server_state

router = APIRouter()


def server_version() -> str:
    try:
        return importlib.metadata.version("cbserve")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def _card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.config.served_model_name,
        created=state.created,
        root=state.engine.model_name,
        max_model_len=state.engine.max_model_len,
    )


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_card(server_state(request))])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    state = server_state(request)
    check_model(model_id, state)
    return _card(state)


@router.get("/health", responses=ERROR_RESPONSES)
async def health(request: Request) -> Response:
    """200 while the engine loop runs and requests are admitted; 503 when it died or while draining."""
    state = server_state(request)
    if state.draining:
        return APIError(503, "the server is shutting down", code="server_draining").response()
    if not state.is_healthy():
        return APIError(503, "the engine loop is not running", code="engine_dead").response()
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": server_version()}


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Prometheus exposition of the engine's and the HTTP layer's metrics."""
    state = server_state(request)
    if state.manager is not None:
        state.metrics.refresh(state.manager.stats())
    body, content_type = state.metrics.render()
    return Response(content=body, media_type=content_type)
