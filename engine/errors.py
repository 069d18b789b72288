"""Errors the engine raises to its callers. The server maps each to an OpenAI-style HTTP error."""

from __future__ import annotations

from collections.abc import Iterable


class EngineError(Exception):
    """Base class of the engine's errors."""


class EngineDeadError(EngineError):
    """The engine loop is not running (stopped, or died): nothing can be admitted. HTTP 503."""


class ExecutorFailedError(EngineError):
    """The executor can run no more steps (a tensor-parallel rank died, hung or fell out of step): the
    engine loop stops and fails every request, and the server exits non-zero so that it is restarted."""


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


class ModelLoadError(EngineError):
    """A model's files are missing, truncated, corrupt or inconsistent."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model named by the user does not exist (no such path, or the default package is missing)."""


class UnsupportedArchitectureError(ModelLoadError, ValueError):
    """The model's architecture is not one cbserve implements."""

    def __init__(self, architecture: str, supported: Iterable[str], where: str | None = None) -> None:
        self.architecture = architecture
        self.supported = tuple(supported)
        place = f" in {where}" if where else ""
        super().__init__(
            f"Unsupported model architecture {architecture!r}{place}. "
            f"Supported architectures: {', '.join(self.supported)}."
        )


class UnsupportedModelError(ModelLoadError, ValueError):
    """A model cbserve refuses at start: its architecture, or a feature of it, cannot run correctly here
    (an encoder-decoder, an attention variant the paged kernels do not compute, ...). The message names
    the model and what is unsupported."""

    def __init__(self, model: str, reason: str) -> None:
        self.model = model
        self.reason = reason
        super().__init__(f"Model {model!r} cannot be served: {reason}.")


class TokenizerMismatchError(ModelLoadError, ValueError):
    """The tokenizer can produce token ids the model has no embedding for."""

    def __init__(self, tokenizer_vocab_size: int, model_vocab_size: int, where: str) -> None:
        self.tokenizer_vocab_size = tokenizer_vocab_size
        self.model_vocab_size = model_vocab_size
        super().__init__(
            f"The tokenizer of {where} has {tokenizer_vocab_size} tokens but the model's vocab_size is "
            f"{model_vocab_size}: token ids >= {model_vocab_size} would index past the embedding table. "
            f"Use the tokenizer that belongs to this model."
        )
