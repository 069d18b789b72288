"""POST /tokenize and POST /detokenize, in vLLM's shapes (clients use them to count tokens)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.errors import APIError
from server.prompts import chat_prompt
from server.schemas import (
    ERROR_RESPONSES,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from server.serving_common import check_model, log_unknown_fields, server_state

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """``{prompt}`` (special tokens added unless ``add_special_tokens`` is false) or ``{messages}``
    (through the chat template)."""
    state = server_state(request)
    check_model(body.model, state)
    log_unknown_fields(body, "tokenize")
    engine = state.engine
    if (body.prompt is None) == (body.messages is None):
        raise APIError(
            400, "give exactly one of 'prompt' or 'messages'", param="prompt", code="invalid_value"
        )
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = [int(t) for t in state.tokenizer.encode(body.prompt, add_special_tokens=add_special)]
    else:
        assert body.messages is not None  # NOTE: checked above; narrows for mypy.
        if not body.messages:
            raise APIError(400, "'messages' is empty", param="messages", code="invalid_value")
        tokens = chat_prompt(
            body.messages, state.tokenizer, engine.model_config.vocab_size, body.add_generation_prompt
        )
    strs = [str(s) for s in state.tokenizer.convert_ids_to_tokens(tokens)] if body.return_token_strs else None
    return TokenizeResponse(
        count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens, token_strs=strs
    )


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = server_state(request)
    check_model(body.model, state)
    log_unknown_fields(body, "detokenize")
    vocab_size = state.engine.model_config.vocab_size
    for t in body.tokens:
        if t < 0 or t >= vocab_size:
            raise APIError(
                400,
                f"token id {t} is outside the vocabulary [0, {vocab_size})",
                param="tokens",
                code="invalid_value",
            )
    return DetokenizeResponse(prompt=str(state.tokenizer.decode(body.tokens, skip_special_tokens=False)))
