"""The OpenAI and vLLM request fields cbserve knows but cannot honour: a 400 that says so, rather than
a 200 that silently ignores what the client asked for.

A field is refused only when its value asks for something: the neutral value a client library sends by
default (``include_stop_str_in_output: false``, ``modalities: ["text"]``, ...) is accepted. Unknown fields that
are not listed here are still ignored and logged once (``serving_common.log_unknown_fields``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.errors import APIError
from server.schemas import SamplingRequest


def _same(value: Any, neutral: Any) -> bool:
    # NOTE: type-exact, so that 1 does not pass for True nor True for 1.
    return type(value) is type(neutral) and value == neutral


@dataclass(frozen=True)
class Unsupported:
    """A field, when its value is neutral, and why any other value cannot be honoured."""

    name: str
    is_neutral: Callable[[Any, SamplingRequest], bool]
    why: str


def _absent(value: Any, body: SamplingRequest) -> bool:
    return value is None


def _false(value: Any, body: SamplingRequest) -> bool:
    return value is None or _same(value, False)


def _true(value: Any, body: SamplingRequest) -> bool:
    return value is None or _same(value, True)


UNSUPPORTED_FIELDS: tuple[Unsupported, ...] = (
    Unsupported("allowed_token_ids", _absent, "use logit_bias or bad_words instead"),
    Unsupported("include_stop_str_in_output", _false, "the matched stop string is always cut off"),
    Unsupported("truncate_prompt_tokens", _absent, "prompts are never truncated"),
    Unsupported("return_tokens_as_token_ids", _false, "tokens are returned as text"),
    Unsupported("spaces_between_special_tokens", _true, "detokenization is the tokenizer's own"),
    Unsupported("continue_final_message", _false, "a final assistant message cannot be continued"),
    Unsupported("echo", _false, "echo exists on /v1/completions only"),
    Unsupported("suffix", lambda v, body: v is None or _same(v, ""), "insertion (suffix) is not supported"),
    Unsupported("functions", _absent, "the deprecated functions API is not supported; use tools"),
    Unsupported("function_call", _absent, "the deprecated functions API is not supported; use tool_choice"),
    Unsupported(
        "modalities",
        lambda v, body: v is None or _same(v, ["text"]),
        "this server generates text only",
    ),
    Unsupported("audio", _absent, "this server generates text only"),
    Unsupported("prediction", _absent, "predicted outputs are not supported"),
    Unsupported(
        "logits_processors",
        _absent,
        "a request cannot load processors; the server's --logits-processors take logits_processor_args",
    ),
)


def check_unsupported_fields(body: SamplingRequest) -> None:
    """A 400 naming the first field of ``body`` that asks for something cbserve cannot do. Only unknown
    fields are looked at: a field the request model declares is honoured by definition."""
    extra = body.model_extra or {}
    for field in UNSUPPORTED_FIELDS:
        if field.name in extra and not field.is_neutral(extra[field.name], body):
            raise APIError(
                400,
                f"'{field.name}' is not supported by this server: {field.why}",
                param=field.name,
                code="unsupported_parameter",
            )
