"""POST /v1/completions: OpenAI's legacy text completions, streaming or not.

Choice ``index`` is ``prompt_i * n + sample_j``. ``echo`` prepends each prompt's text (with ``logprobs``,
its tokens appear with null log-probabilities).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response

from server.engine_client import output_error
from server.errors import APIError
from server.lifecycle import ServerState
from server.logprobs_format import (
    TokenStrings,
    completion_logprobs,
    concat,
    prompt_logprobs,
    vllm_prompt_logprobs,
)
from server.prompts import completion_prompts, num_prompts
from server.schemas import (
    ERROR_RESPONSES,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from server.serving_common import (
    Admitted,
    admit,
    check_fits_queue,
    check_model,
    final_outputs,
    finish_reason,
    log_unknown_fields,
    server_state,
    streaming_response,
    usage,
)
from server.sse import DONE_EVENT, sse_event
from server.structured_outputs import structured_output_spec

logger = logging.getLogger(__name__)

router = APIRouter()


def echo_texts(body: CompletionRequest, prompts: list[list[int]], tokenizer: Any) -> list[str]:
    """The text ``echo`` prepends: the prompt as sent when it was text, else its ids decoded."""
    if isinstance(body.prompt, str):
        return [body.prompt]
    if body.prompt and all(isinstance(p, str) for p in body.prompt):
        return [str(p) for p in body.prompt]
    return [str(tokenizer.decode(p, skip_special_tokens=False)) for p in prompts]


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request) -> CompletionResponse | Response:
    state = server_state(request)
    check_model(body.model, state)
    log_unknown_fields(body, "completions")
    check_fits_queue(state, num_prompts(body.prompt), "prompt")
    tokenizer = state.tokenizer
    prompts = completion_prompts(body.prompt, tokenizer, state.engine.model_config.vocab_size)
    want_logprobs = body.logprobs is not None
    admitted = await admit(
        state,
        request,
        body,
        prompts,
        want_logprobs,
        body.logprobs or 0,
        id_prefix="cmpl",
        prompt_param="prompt",
        structured_output=structured_output_spec(body),
    )
    echoes = echo_texts(body, prompts, tokenizer) if body.echo else ["" for _ in prompts]
    if body.stream:
        return streaming_response(state, admitted, _stream(state, body, admitted, echoes))
    finals = await final_outputs(state, request, admitted)
    if finals is None:
        return Response(status_code=499)
    return _response(state, body, admitted, echoes, finals)


def _response(
    state: ServerState, body: CompletionRequest, admitted: Admitted, echoes: list[str], finals: dict[Any, Any]
) -> CompletionResponse:
    strings = TokenStrings(state.tokenizer)
    running = state.manager is not None and state.manager.is_running()
    choices: list[CompletionChoice] = []
    num_completion_tokens = 0
    for i, prompt in enumerate(admitted.submission.prompts):
        for j in range(body.n):
            out = finals[(i, j)]
            error = output_error(out, running)
            if error is not None:
                raise error
            num_completion_tokens += len(out.generated_ids)
            logprobs: CompletionLogprobs | None = None
            if body.logprobs is not None:
                logprobs, _ = completion_logprobs(out.logprobs or [], strings, body.logprobs, len(echoes[i]))
                if body.echo:
                    echoed = prompt_logprobs(prompt, out.prompt_logprobs, strings, body.logprobs)[0]
                    logprobs = concat(echoed, logprobs)
            choices.append(
                CompletionChoice(
                    index=i * body.n + j,
                    text=echoes[i] + out.text,
                    logprobs=logprobs,
                    finish_reason=finish_reason(out),  # type: ignore[arg-type]
                    prompt_logprobs=vllm_prompt_logprobs(out.prompt_logprobs, strings, body.prompt_logprobs)
                    if body.prompt_logprobs is not None
                    else None,
                )
            )
    return CompletionResponse(
        id=admitted.response_id,
        created=admitted.created,
        model=admitted.model,
        choices=choices,
        usage=usage(admitted.submission.num_prompt_tokens, num_completion_tokens),
    )


async def _stream(
    state: ServerState, body: CompletionRequest, admitted: Admitted, echoes: list[str]
) -> AsyncIterator[bytes]:
    strings = TokenStrings(state.tokenizer)
    include_usage = body.include_usage

    def chunk(index: int, text: str, logprobs: CompletionLogprobs | None, reason: str | None) -> bytes:
        return _chunk(admitted, include_usage, index, text, logprobs, reason)

    n = body.n
    offsets: dict[int, int] = {}
    num_completion_tokens = 0
    # NOTE: with logprobs, a choice's echo waits for its first output, which carries the prompt's
    # log-probabilities (computed by the prefill); without, it goes out at once.
    echo_later = body.echo and body.logprobs is not None
    try:
        for i in range(len(admitted.submission.prompts)):
            for j in range(n):
                offsets[i * n + j] = len(echoes[i])
                if body.echo and not echo_later:
                    yield chunk(i * n + j, echoes[i], None, None)
        echoed: set[int] = set()
        async for i, out in admitted.submission.outputs():
            error = output_error(out, state.manager is not None and state.manager.is_running())
            if error is not None:
                yield sse_event(error.body())
                yield DONE_EVENT
                return
            index = i * n + out.index
            if echo_later and index not in echoed:
                echoed.add(index)
                prompt = admitted.submission.prompts[i]
                lp = prompt_logprobs(prompt, out.prompt_logprobs, strings, body.logprobs or 0)[0]
                yield chunk(index, echoes[i], lp, None)
            logprobs: CompletionLogprobs | None = None
            if body.logprobs is not None and out.delta_logprobs:
                logprobs, offsets[index] = completion_logprobs(
                    out.delta_logprobs, strings, body.logprobs, offsets[index]
                )
            if out.delta_text or logprobs is not None:
                yield chunk(index, out.delta_text, logprobs, None)
            if out.is_finished:
                num_completion_tokens += len(out.generated_ids)
                yield chunk(index, "", None, finish_reason(out))
        if include_usage:
            yield _usage_chunk(admitted, num_completion_tokens)
        yield DONE_EVENT
    except APIError as exc:
        yield sse_event(exc.body())
        yield DONE_EVENT
    except Exception as exc:  # NOTE: the status line is sent already: the error must travel in the stream.
        logger.exception("completion stream %s failed", admitted.response_id)
        yield sse_event(
            APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error").body()
        )
        yield DONE_EVENT


def _usage_chunk(admitted: Admitted, num_completion_tokens: int) -> bytes:
    """The last event of a stream with ``include_usage``: no choices, the request's usage."""
    return sse_event(
        {
            "id": admitted.response_id,
            "object": "text_completion",
            "created": admitted.created,
            "model": admitted.model,
            "choices": [],
            "usage": usage(admitted.submission.num_prompt_tokens, num_completion_tokens).model_dump(),
        }
    )


def _chunk(
    admitted: Admitted,
    include_usage: bool,
    index: int,
    text: str,
    logprobs: CompletionLogprobs | None,
    reason: str | None,
) -> bytes:
    """One ``text_completion`` SSE event for choice ``index`` (``usage: null`` when usage comes at the end)."""
    payload: dict[str, Any] = {
        "id": admitted.response_id,
        "object": "text_completion",
        "created": admitted.created,
        "model": admitted.model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": logprobs.model_dump() if logprobs is not None else None,
                "finish_reason": reason,
            }
        ],
    }
    if include_usage:
        payload["usage"] = None
    return sse_event(payload)
