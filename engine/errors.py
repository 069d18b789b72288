"""Errors the engine raises to its callers. The server maps each to an OpenAI-style HTTP error."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of the engine's errors."""


class EngineDeadError(EngineError):
    """The engine loop is not running (stopped, or died): nothing can be admitted. HTTP 503."""


class QueueFullError(EngineError):
    """The waiting queue holds ``max_queue`` requests already. HTTP 429."""


class ContextLengthExceededError(EngineError, ValueError):
    """The prompt (plus the tokens asked for) is longer than the model's context. HTTP 400,
    code ``context_length_exceeded``."""

    def __init__(self, prompt_len: int, max_new_tokens: int, limit: int) -> None:
        self.prompt_len = prompt_len
        self.max_new_tokens = max_new_tokens
        self.limit = limit
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_new_tokens} tokens ({prompt_len} in the prompt, {max_new_tokens} for the "
            f"completion). Please reduce the length of the prompt or the completion."
        )


class UnsatisfiableOptionsError(EngineError, ValueError):
    """Found while generating: the request's own options leave no token that can be sampled (every token
    masked, or a penalty that overflows the logits). The request fails alone; HTTP 400, code
    ``invalid_generation_options``."""

    code = "invalid_generation_options"


class InvalidRequestError(EngineError, ValueError):
    """A request the engine cannot run (empty prompt, token id outside the vocabulary, ...). HTTP 400.
    ``param`` names the offending field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)
