"""What the generation routes (completions, chat) share: the server state, the model-name check, unknown
field logging, the steps from a parsed request to submitted engine requests, finish reasons and usage."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from engine.errors import ContextLengthExceededError
from engine.generation.config import GenerationConfig, GenerationConfigError
from engine.generation.grammar_spec import GrammarSpec
from engine.outputs import GenerationOutput
from scheduler.request import FinishReason
from server.engine_client import (
    ClientDisconnected,
    Submission,
    collect_final_outputs,
    compile_grammar,
    submit_prompts,
)
from server.errors import APIError, api_error_from_engine
from server.generation_params import bad_words_ids, build_generation_config, resolve_max_tokens
from server.lifecycle import ServerState
from server.middleware.request_id import request_id_of
from server.schemas import SamplingRequest, UsageInfo
from server.sse import EventStreamResponse
from server.unsupported_fields import check_unsupported_fields

logger = logging.getLogger(__name__)

_unknown_fields_seen: set[str] = set()
_engine_ids = itertools.count()


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


def check_model(requested: str | None, state: ServerState) -> None:
    """``model`` must be omitted or name the served model (404 otherwise, as OpenAI answers)."""
    if requested is not None and requested != state.config.served_model_name:
        raise APIError(
            404,
            f"the model '{requested}' does not exist; this server serves '{state.config.served_model_name}'",
            param="model",
            code="model_not_found",
        )


def check_fits_queue(state: ServerState, num_prompts: int, param: str) -> None:
    """A request is admitted whole (one queue entry per prompt; the ``n`` samples of a prompt share its
    entry), so one with more prompts than the whole waiting queue holds can never be: a 400, not a 429
    that no retry could satisfy. Checked before any prompt is tokenized."""
    max_queue = state.config.max_queue
    if num_prompts > max_queue:
        raise APIError(
            400,
            f"the request has {num_prompts} prompts but the waiting queue holds at most {max_queue} "
            "requests, so it can never be admitted: send fewer prompts per request",
            param=param,
            code="request_too_large",
        )


def log_unknown_fields(body: SamplingRequest | object, route: str) -> None:
    """Unknown request fields: a 400 for one that cbserve knows but cannot honour (unsupported_fields.py);
    the others are ignored, each field name logged once per process (not per request, which would flood
    the log with one client's habits)."""
    if isinstance(body, SamplingRequest):
        check_unsupported_fields(body)
    extra = getattr(body, "model_extra", None) or {}
    for name in extra:
        key = f"{route}:{name}"
        if key not in _unknown_fields_seen:
            _unknown_fields_seen.add(key)
            logger.warning("%s: ignoring unknown request field %r (logged once)", route, name)


def finish_reason(out: GenerationOutput) -> str:
    """OpenAI's ``finish_reason`` of a finished sample: ``length`` or ``stop``."""
    return "length" if out.finish_reason is FinishReason.LENGTH else "stop"


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


@dataclass(frozen=True)
class Admitted:
    """A request whose prompts are submitted to the engine."""

    submission: Submission
    response_id: str
    created: int
    model: str


async def admit(
    state: ServerState,
    request: Request,
    body: SamplingRequest,
    prompts: list[list[int]],
    output_logprobs: bool,
    top_logprobs: int,
    id_prefix: str,
    prompt_param: str,
    structured_output: GrammarSpec | None = None,
) -> Admitted:
    """Resolve every prompt's config (all checked before any is submitted), compile the
    ``structured_output`` every output must match (on a grammar worker, awaited: never on the event
    loop), then submit them all."""
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(
            400,
            "prompt_logprobs: not available with stream: true (ask without streaming, or use echo with logprobs)",
            param="prompt_logprobs",
            code="invalid_value",
        )
    manager = state.running_manager()
    engine = state.engine
    bad_words = bad_words_ids(body.bad_words, state.tokenizer) if body.bad_words else None
    try:
        configs: list[GenerationConfig] = []
        for prompt in prompts:
            max_new = resolve_max_tokens(
                body,
                len(prompt),
                engine.max_model_len,
                engine.num_blocks * engine.block_size,
                engine.generation_defaults,
            )
            configs.append(
                build_generation_config(
                    body,
                    engine.generation_defaults,
                    max_new,
                    output_logprobs,
                    top_logprobs,
                    structured_output,
                    bad_words,
                    state.config.watermarking_config,
                )
            )
    except (ContextLengthExceededError, GenerationConfigError) as exc:
        error = api_error_from_engine(exc, prompt_param)
        assert error is not None  # NOTE: both types are mapped; narrows for mypy.
        raise error from exc
    grammar = await compile_grammar(manager, structured_output, prompt_param)
    rid = request_id_of(request.scope)
    # NOTE: a client may reuse its X-Request-Id; the engine's ids must stay unique, hence the counter.
    base_id = f"{rid}-{next(_engine_ids)}"
    submission = submit_prompts(manager, prompts, configs, base_id, prompt_param, grammar)
    return Admitted(submission, f"{id_prefix}-{rid}", int(time.time()), state.config.served_model_name)


def streaming_response(
    state: ServerState, admitted: Admitted, events: AsyncIterator[bytes]
) -> EventStreamResponse:
    """An SSE response that counts as in flight (for draining) until it closes, and cancels the request's
    engine work when the client goes away."""
    active = state.acquire()

    def on_close() -> None:
        admitted.submission.cancel()
        active.release()

    return EventStreamResponse(events, on_close)


async def final_outputs(
    state: ServerState, request: Request, admitted: Admitted
) -> dict[tuple[int, int], GenerationOutput] | None:
    """Every sample's final output, or None when the client left (its requests are then cancelled)."""
    with state.track():
        try:
            return await collect_final_outputs(admitted.submission, request)
        except ClientDisconnected:
            logger.info("client disconnected; request %s cancelled", admitted.response_id)
            return None
