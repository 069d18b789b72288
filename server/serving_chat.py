"""POST /v1/chat/completions: the messages through the model's chat template, then generation.

Streams as OpenAI does: per choice a first chunk with ``{"role": "assistant", "content": ""}``, then
content deltas (or tool-call deltas: server/tool_stream.py), then a chunk with an empty delta and the
``finish_reason``; with
``stream_options.include_usage`` a last chunk with ``choices: []`` and the usage; then ``[DONE]``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response

from engine.generation.grammar_spec import GrammarSpec
from engine.outputs import GenerationOutput
from server.engine_client import output_error
from server.errors import APIError
from server.lifecycle import ServerState
from server.logprobs_format import TokenStrings, chat_logprobs, vllm_prompt_logprobs
from server.prompts import chat_prompt, template_knows_tools
from server.reasoning_output import ChatReasoning
from server.schemas import (
    ERROR_RESPONSES,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ToolDefinition,
)
from server.serving_common import (
    Admitted,
    admit,
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
from server.tool_calls import (
    auto_tool_spec,
    auto_tools,
    forced_tools,
    parse_tool_calls,
    scanned_tool_calls,
    tool_call_spec,
)
from server.tool_parser import Scan
from server.tool_stream import ToolCallStreamer
from server.tool_syntax import SYNTAXES, ToolSyntax, tool_syntax

logger = logging.getLogger(__name__)

router = APIRouter()


def _num_top(body: ChatCompletionRequest) -> int:
    if body.top_logprobs is not None and body.top_logprobs > 0 and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
    return body.top_logprobs or 0


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request
) -> ChatCompletionResponse | Response:
    state = server_state(request)
    check_model(body.model, state)
    log_unknown_fields(body, "chat")
    num_top = _num_top(body)
    tools = forced_tools(body)
    auto = auto_tools(body)
    knows_tools = template_knows_tools(state.tokenizer)
    spec = _output_spec(body, tools, auto, knows_tools)
    syntax = tool_syntax(state.config.tool_call_parser, getattr(state.tokenizer, "chat_template", None))
    if auto and knows_tools and syntax.keep_special_tokens:
        # NOTE: the syntax's markers ([TOOL_CALLS], [ARGS]) are special tokens: the parser must see them.
        body = body.model_copy(update={"skip_special_tokens": False})
    auto_syntax = syntax if auto and knows_tools else SYNTAXES["hermes"] if auto else None
    engine = state.engine
    prompt = chat_prompt(
        body.messages,
        state.tokenizer,
        engine.model_config.vocab_size,
        body.add_generation_prompt,
        body.tools,
        body.chat_template_kwargs,
        auto_tools=bool(auto),
    )
    reasoning = ChatReasoning.for_request(state, prompt)
    admitted = await admit(
        state,
        request,
        body,
        [prompt],
        body.logprobs,
        num_top,
        id_prefix="chatcmpl",
        prompt_param="messages",
        structured_output=spec,
    )
    if body.stream:
        stream = _stream(state, body, admitted, num_top, tools, auto_syntax, reasoning)
        return streaming_response(state, admitted, stream)
    finals = await final_outputs(state, request, admitted)
    if finals is None:
        return Response(status_code=499)
    return _response(state, body, admitted, num_top, finals, tools, auto_syntax, reasoning)


def _output_spec(
    body: ChatCompletionRequest,
    tools: list[ToolDefinition],
    auto: list[ToolDefinition],
    knows_tools: bool,
) -> GrammarSpec | None:
    """What the output must match: a forced tool call, a reply or calls (``auto`` with a template that
    knows no tools; one that knows them has its own syntax, only parsed), or the structured output."""
    requested = structured_output_spec(body)
    if not tools and not auto:
        return requested
    if requested is not None:
        raise APIError(
            400,
            f"{requested.field}: cannot be combined with tool calls (tools with tool_choice other than 'none')",
            param=requested.field,
            code="invalid_value",
        )
    if tools:
        return tool_call_spec(body, tools)
    return None if knows_tools else auto_tool_spec(body, auto)


def _auto_message(
    scanned: Scan, text: str, reason: str, syntax: ToolSyntax
) -> tuple[ChatResponseMessage, str]:
    """An ``auto`` output's message: its calls (``tool_calls`` when all are complete) or its text."""
    if scanned.mode != "calls":
        return ChatResponseMessage(content=text), reason
    calls = scanned_tool_calls(scanned, syntax.new_call_id)
    return ChatResponseMessage(content=None, tool_calls=calls), (
        "tool_calls" if reason == "stop" and scanned.all_complete else reason
    )


def _message(
    body: ChatCompletionRequest, tools: list[ToolDefinition], auto: ToolSyntax | None, out: GenerationOutput
) -> tuple[ChatResponseMessage, str]:
    """The assistant message of one finished sample and its finish reason: a forced call that completed,
    or ``auto`` calls, become ``tool_calls`` (content null); anything else stays text."""
    reason = finish_reason(out)
    if auto:
        return _auto_message(auto.scan(out.text, True), out.text, reason, auto)
    if tools and reason == "stop":
        return ChatResponseMessage(
            content=None, tool_calls=parse_tool_calls(body, tools, out.text)
        ), "tool_calls"
    return ChatResponseMessage(content=out.text), reason


def _response(
    state: ServerState,
    body: ChatCompletionRequest,
    admitted: Admitted,
    num_top: int,
    finals: dict[Any, Any],
    tools: list[ToolDefinition],
    auto: ToolSyntax | None,
    reasoning: ChatReasoning,
) -> ChatCompletionResponse:
    strings = TokenStrings(state.tokenizer)
    running = state.manager is not None and state.manager.is_running()
    choices: list[ChatChoice] = []
    num_completion_tokens = 0
    for j in range(body.n):
        out = finals[(0, j)]
        error = output_error(out, running)
        if error is not None:
            raise error
        num_completion_tokens += len(out.generated_ids)
        logprobs = (
            ChatLogprobs(content=chat_logprobs(out.logprobs or [], strings, num_top))
            if body.logprobs
            else None
        )
        message, reason = _message(body, tools, auto, out)
        message = reasoning.message(message)
        choices.append(
            ChatChoice(index=j, message=message, logprobs=logprobs, finish_reason=reason)  # type: ignore[arg-type]
        )
    first = finals[(0, 0)]
    return ChatCompletionResponse(
        id=admitted.response_id,
        created=admitted.created,
        model=admitted.model,
        choices=choices,
        usage=usage(admitted.submission.num_prompt_tokens, num_completion_tokens),
        prompt_logprobs=vllm_prompt_logprobs(first.prompt_logprobs, strings, body.prompt_logprobs)
        if body.prompt_logprobs is not None
        else None,
    )


def _tool_call_deltas(message: ChatResponseMessage) -> list[dict[str, Any]]:
    """OpenAI's tool-call deltas of a message: per call its id and name first, then its arguments."""
    deltas: list[dict[str, Any]] = []
    for i, call in enumerate(message.tool_calls or []):
        head = {
            "index": i,
            "id": call.id,
            "type": "function",
            "function": {"name": call.function.name, "arguments": ""},
        }
        deltas.append({"tool_calls": [head]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.function.arguments}}]})
    return deltas


def _content_step(
    body: ChatCompletionRequest,
    strings: TokenStrings,
    num_top: int,
    out: GenerationOutput,
    reasoning: ChatReasoning,
) -> tuple[list[tuple[dict[str, Any], Any]], str | None]:
    """The content delta (reasoning split out, with its logprobs) of one output of a choice, and its
    finish reason once finished."""
    logprobs = None
    if body.logprobs and out.delta_logprobs:
        entries = chat_logprobs(out.delta_logprobs, strings, num_top)
        logprobs = {"content": [e.model_dump() for e in entries]}
    delta = reasoning.delta(out.index, out.delta_text, out.is_finished)
    pieces = [(delta or {"content": ""}, logprobs)] if delta or logprobs is not None else []
    return pieces, finish_reason(out) if out.is_finished else None


def _step_deltas(
    body: ChatCompletionRequest,
    tools: list[ToolDefinition],
    streamer: ToolCallStreamer | None,
    out: GenerationOutput,
) -> tuple[list[dict[str, Any]], str | None]:
    """The deltas of one tool-call output of a choice, and its finish reason once finished."""
    if streamer is not None:
        deltas = streamer.deltas(out.text, out.is_finished)
        if not out.is_finished:
            return deltas, None
        return deltas, _auto_message(streamer.scan, out.text, finish_reason(out), streamer.syntax)[1]
    # NOTE: a forced tool call is sent whole once it is complete (then it surely parses).
    if not out.is_finished:
        return [], None
    message, reason = _message(body, tools, None, out)
    return (_tool_call_deltas(message) if message.tool_calls else [{"content": out.text}]), reason


async def _stream(
    state: ServerState,
    body: ChatCompletionRequest,
    admitted: Admitted,
    num_top: int,
    tools: list[ToolDefinition],
    auto: ToolSyntax | None,
    reasoning: ChatReasoning,
) -> AsyncIterator[bytes]:
    strings = TokenStrings(state.tokenizer)
    include_usage = body.include_usage
    streamers = {j: ToolCallStreamer(auto) for j in range(body.n)} if auto else {}

    def chunk(choices: list[dict[str, Any]], usage_info: dict[str, Any] | None = None) -> bytes:
        return _chunk(admitted, include_usage, choices, usage_info)

    num_completion_tokens = 0
    try:
        for j in range(body.n):
            yield chunk([_choice(j, {"role": "assistant", "content": ""})])
        async for _, out in admitted.submission.outputs():
            error = output_error(out, state.manager is not None and state.manager.is_running())
            if error is not None:
                yield sse_event(error.body())
                yield DONE_EVENT
                return
            if tools or auto:
                deltas, reason = _step_deltas(body, tools, streamers.get(out.index), out)
                pieces: list[tuple[dict[str, Any], Any]] = [(delta, None) for delta in deltas]
            else:
                pieces, reason = _content_step(body, strings, num_top, out, reasoning)
            for delta, logprobs in pieces:
                yield chunk([_choice(out.index, delta, logprobs)])
            if out.is_finished:
                num_completion_tokens += len(out.generated_ids)
                yield chunk([_choice(out.index, {}, None, reason)])
        if include_usage:
            info = usage(admitted.submission.num_prompt_tokens, num_completion_tokens)
            yield chunk([], info.model_dump())
        yield DONE_EVENT
    except APIError as exc:
        yield sse_event(exc.body())
        yield DONE_EVENT
    except Exception as exc:  # NOTE: the status line is sent already: the error must travel in the stream.
        logger.exception("chat stream %s failed", admitted.response_id)
        yield sse_event(
            APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error").body()
        )
        yield DONE_EVENT


def _chunk(
    admitted: Admitted, include_usage: bool, choices: list[dict[str, Any]], usage_info: dict[str, Any] | None
) -> bytes:
    """One ``chat.completion.chunk`` SSE event (``usage: null`` when usage comes at the end)."""
    payload: dict[str, Any] = {
        "id": admitted.response_id,
        "object": "chat.completion.chunk",
        "created": admitted.created,
        "model": admitted.model,
        "choices": choices,
    }
    if include_usage:
        payload["usage"] = usage_info
    return sse_event(payload)


def _choice(
    index: int, delta: dict[str, Any], logprobs: Any = None, reason: str | None = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
