"""Request prompts -> token ids: the completions ``prompt`` forms and chat ``messages`` through the
model's chat template. Every prompt is checked here (not empty, ids inside the vocabulary) so that a bad
one is a 400 before anything is submitted."""

from __future__ import annotations

import json
from typing import Any

from server.errors import APIError
from server.schemas import ChatMessage, ToolDefinition
from server.tool_calls import tools_system_prompt
from server.tool_parser import CALL_CLOSE, CALL_OPEN


def _check_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    if not ids:
        raise APIError(
            400, f"'{param}' is empty: at least one token is needed", param=param, code="invalid_value"
        )
    for t in ids:
        if t < 0 or t >= vocab_size:
            raise APIError(
                400,
                f"token id {t} is outside the vocabulary [0, {vocab_size})",
                param=param,
                code="invalid_value",
            )
    return ids


def num_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    """How many prompts a completions ``prompt`` holds, before any is tokenized."""
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def completion_prompts(
    prompt: str | list[str] | list[int] | list[list[int]], tokenizer: Any, vocab_size: int
) -> list[list[int]]:
    """Token ids of every prompt of a completions request (a string, strings, ids, or id lists)."""
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif not prompt:
        raise APIError(400, "'prompt' is an empty list", param="prompt", code="invalid_value")
    elif all(isinstance(p, int) for p in prompt):
        items = [[p for p in prompt if isinstance(p, int)]]
    else:
        items = [p for p in prompt if isinstance(p, (str, list))]
    out: list[list[int]] = []
    for item in items:
        ids = tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else list(item)
        out.append(_check_ids(ids, vocab_size, "prompt"))
    return out


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: ``content`` a string (text parts joined by newlines,
    as vLLM joins them). Non-text parts are refused: this server runs text-only models."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts: list[str] = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"messages[{i}]: content part of type {part.type!r} is not supported (text only)",
                        param="messages",
                        code="invalid_value",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        d: dict[str, Any] = {"role": message.role, "content": content if content is not None else ""}
        if message.name is not None:
            d["name"] = message.name
        if message.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in message.tool_calls]
        if message.tool_call_id is not None:
            d["tool_call_id"] = message.tool_call_id
        out.append(d)
    return out


def _hermes_calls(calls: list[dict[str, Any]]) -> str:
    """Earlier calls as the generic format writes them (server/tool_parser.py)."""
    blocks = []
    for call in calls:
        name = json.dumps(call["function"]["name"], ensure_ascii=False)
        arguments = call["function"]["arguments"] or "{}"
        blocks.append(f'{CALL_OPEN}\n{{"name": {name}, "arguments": {arguments}}}\n{CALL_CLOSE}')
    return "\n".join(blocks)


def _without_template_tools(messages: list[dict[str, Any]], tools_prompt: str) -> list[dict[str, Any]]:
    """For a template that knows no tools: the tools described in the system message, and earlier calls
    written into their assistant message's content (Hermes syntax) so that the model sees them."""
    out = [dict(m) for m in messages]
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            m["content"] = "\n".join(part for part in (m["content"], _hermes_calls(calls)) if part)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{tools_prompt}"
    else:
        out.insert(0, {"role": "system", "content": tools_prompt})
    return out


def _arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier calls' ``arguments`` as objects, as transformers' chat templates take them (Llama's and
    Mistral's write ``arguments | tojson``: a JSON string would be written twice encoded)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(m)
    return out


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except (TypeError, ValueError):
        return call  # NOTE: not JSON: the template gets the string as it came
    return {**call, "function": {**call["function"], "arguments": arguments}}


def template_knows_tools(tokenizer: Any) -> bool:
    """The chat template reads ``tools`` (else the generic format describes them in a system message)."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def chat_prompt(
    messages: list[ChatMessage],
    tokenizer: Any,
    vocab_size: int,
    add_generation_prompt: bool,
    tools: list[ToolDefinition] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    auto_tools: bool = False,
) -> list[int]:
    """The token ids of ``messages`` rendered by the model's chat template. ``tools`` reach the template
    as ``tools`` (as transformers passes them); a template that never reads them gets them described in
    a system message instead (with how to call them when ``auto_tools``: the model may answer instead).
    ``template_kwargs`` (the request's ``chat_template_kwargs``) are more template variables."""
    dicts = message_dicts(messages)
    extra: dict[str, Any] = dict(template_kwargs or {})
    if tools:
        if template_knows_tools(tokenizer):
            extra["tools"] = [t.model_dump(exclude_none=True) for t in tools]
            dicts = _arguments_as_objects(dicts)
        else:
            dicts = _without_template_tools(dicts, tools_system_prompt(tools, auto_tools))
    try:
        rendered = tokenizer.apply_chat_template(
            dicts, add_generation_prompt=add_generation_prompt, tokenize=True, **extra
        )
    except APIError:
        raise
    except ValueError as exc:  # ChatTemplateError (a ValueError): no template, or it rejected the messages
        raise APIError(400, str(exc), param="messages", code="invalid_value") from exc
    if isinstance(rendered, str):
        # NOTE: the template text already holds its special tokens; do not add them twice.
        ids = tokenizer.encode(rendered, add_special_tokens=False)
    else:
        ids = list(rendered)
    return _check_ids(ids, vocab_size, "messages")
