"""OpenAI-style errors: every error response, whatever raised it, has the body

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

``APIError`` is what handlers raise; ``api_error_from_engine`` maps the engine's exceptions to it and
``install_error_handlers`` makes FastAPI's own errors (422 validation, 404 routes, 405 methods, bad JSON)
use the same body; ``server/middleware/unexpected_errors.py`` turns any other exception into a 500 with it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import ContextLengthExceededError, EngineDeadError, InvalidRequestError, QueueFullError

logger = logging.getLogger(__name__)

# The error ``type`` for each status, as OpenAI's API names them.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


# The request field behind each ``GenerationConfig`` option whose name differs (for error ``param``).
REQUEST_FIELD_OF_OPTION = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "stop_strings": "stop",
    "num_return_sequences": "n",
    "output_logprobs": "logprobs",
    "bad_words_ids": "bad_words",
}


class APIError(Exception):
    """An error to send as an OpenAI error body with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_bytes(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    """The JSON body of an error, for the ASGI middlewares that answer before FastAPI runs."""
    return json.dumps(APIError(status, message, param, code).body()).encode()


def api_error_from_engine(exc: Exception, prompt_param: str = "prompt") -> APIError | None:
    """The HTTP error for an exception raised by ``manager.submit`` or ``GenerationConfig``, or None when
    it is not one the engine raises on purpose (a bug: the caller lets it become a 500). ``prompt_param``
    names the request field holding the prompt (``messages`` for chat)."""
    # NOTE: imported here so that this module does not pull in torch-heavy engine modules at import time.
    from engine.generation.config import GenerationConfigError
    from scheduler.errors import RequestTooLargeError

    if isinstance(exc, ContextLengthExceededError):
        return APIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        param = prompt_param if exc.param == "prompt" else exc.param
        return APIError(400, str(exc), param=param, code="invalid_value")
    if isinstance(exc, RequestTooLargeError):
        return APIError(400, str(exc), code="request_too_large")
    if isinstance(exc, GenerationConfigError):
        field = getattr(exc, "field", None)
        param = REQUEST_FIELD_OF_OPTION.get(field, field) if isinstance(field, str) else None
        return APIError(400, str(exc), param=param, code="invalid_value")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="queue_full")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    return None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line naming the offending field(s), and the first field's name as ``param``."""
    parts: list[str] = []
    param: str | None = None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            parts.append(f"malformed JSON body: {ctx.get('error', err.get('msg', 'invalid JSON'))}")
            continue
        field = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        if err.get("type") == "missing" and field:
            parts.append(f"missing required field '{field}'")
        elif err.get("type") == "missing":
            parts.append("the request body is missing: a JSON object is expected")
        elif field:
            # NOTE: pydantic prefixes the message of a ValueError raised by a validator; ours say it all.
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            parts.append(f"invalid value for '{field}': {msg}")
        else:
            parts.append(str(err.get("msg", "invalid request body")))
    # NOTE: a union (e.g. ``prompt``) reports one error per member; keep the message short.
    unique = list(dict.fromkeys(parts))
    message = "; ".join(unique[:4]) + (f" (and {len(unique) - 4} more)" if len(unique) > 4 else "")
    return message or "invalid request body", param


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)  # NOTE: registered for APIError only; narrows the type for mypy.
    return exc.response()


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_message(exc)
    return APIError(400, message, param=param, code="invalid_value").response()


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
        code: str | None = "not_found"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
        code = "method_not_allowed"
    else:
        message = str(exc.detail)
        code = None
    return APIError(exc.status_code, message, code=code).response(headers=getattr(exc, "headers", None))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
