"""POST /v1/watermark/detect: is a generated output watermarked? transformers' ``WatermarkDetector``
numbers for a green-list watermark, SynthID's scores for a SynthID one (engine/generation/watermark_detect.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from engine.errors import InvalidRequestError
from engine.generation.config import GenerationConfigError
from server.errors import APIError, api_error_from_engine
from server.schemas import ERROR_RESPONSES, WatermarkDetectRequest, WatermarkDetectResponse
from server.serving_common import check_model, log_unknown_fields, server_state

router = APIRouter()


@router.post(
    "/v1/watermark/detect",
    response_model=WatermarkDetectResponse,
    response_model_exclude_none=True,
    responses=ERROR_RESPONSES,
)
async def detect(body: WatermarkDetectRequest, request: Request) -> WatermarkDetectResponse:
    """``{"text" | "tokens", "watermarking_config"}``: the text is tokenized without special tokens; the
    config defaults to the server's ``--watermarking-config``. At most ``max_model_len`` tokens."""
    state = server_state(request)
    check_model(body.model, state)
    log_unknown_fields(body, "watermark_detect")
    if (body.text is None) == (body.tokens is None):
        raise APIError(400, "give exactly one of 'text' or 'tokens'", param="text", code="invalid_value")
    config = (
        body.watermarking_config if body.watermarking_config is not None else state.config.watermarking_config
    )
    if config is None:
        raise APIError(
            400,
            "watermarking_config: is required (this server has no default --watermarking-config)",
            param="watermarking_config",
            code="invalid_value",
        )
    engine = state.engine
    tokens = (
        body.tokens
        if body.tokens is not None
        else state.tokenizer.encode(body.text, add_special_tokens=False)
    )
    if len(tokens) > engine.max_model_len:
        raise APIError(
            400,
            f"{len(tokens)} tokens: at most max_model_len ({engine.max_model_len}) are scored in one request",
            param="tokens" if body.tokens is not None else "text",
            code="invalid_value",
        )
    try:
        # NOTE: a green list is one generator draw per distinct n-gram: off the event loop.
        found = await run_in_threadpool(
            engine.detect_watermark, tokens, config, body.z_threshold, body.ignore_repeated_ngrams
        )
    except (GenerationConfigError, InvalidRequestError) as exc:
        error = api_error_from_engine(exc)
        assert error is not None  # NOTE: both types are mapped; narrows for mypy.
        if body.text is not None and error.param == "tokens":
            error.param = "text"
        raise error from exc
    return WatermarkDetectResponse(
        num_tokens_scored=found.num_tokens_scored,
        num_green_tokens=found.num_green_tokens,
        green_fraction=found.green_fraction,
        mean_score=found.mean_score,
        weighted_mean_score=found.weighted_mean_score,
        z_score=found.z_score,
        p_value=found.p_value,
        prediction=found.prediction,
    )
