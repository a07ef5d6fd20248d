"""Errors at the HTTP edge, all in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.

The ``type`` names are Anthropic's (``invalid_request_error``, ``authentication_error``,
``not_found_error``, ``overloaded_error``, ``api_error``), which OpenAI clients accept as well; on the
Anthropic route the body also carries ``"type": "error"`` at the top, so both SDKs parse it.
Nothing here ever puts a stack trace in a response.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from plinth.model.tokenizer import ChatTemplateError, InvalidText
from plinth.runtime.engine import InvalidRequest
from plinth.server.async_engine import EngineError, EngineOverloaded, EngineStopped
from plinth.validation import InvalidParameter

logger = logging.getLogger(__name__)

#: the ``Retry-After`` of a 503 (overloaded, or shutting down: a balancer retries another replica)
RETRY_AFTER_S = 5

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-shaped body.

    :param param: the request field at fault, when one is.
    """

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None) -> None:
        # the message names the field as well, for clients that show only the message
        if param and not message.startswith(param):
            message = f"{param}: {message}"
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str, param: str | None = None, type_: str | None = None) -> dict[str, Any]:
    """The JSON body of an error (without the Anthropic ``"type": "error"`` marker)."""
    err = APIError(status, message, param, type_)
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}}


def error_headers(status: int) -> dict[str, str] | None:
    """The headers an error response of ``status`` carries."""
    if status == 401:
        return {"WWW-Authenticate": "Bearer"}
    if status == 503:
        return {"Retry-After": str(RETRY_AFTER_S)}
    return None


def error_json(path: str, status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The error body for a route: the OpenAI shape, plus Anthropic's ``"type": "error"`` on /v1/messages."""
    body = error_body(status, message, param)
    return {"type": "error", **body} if path.startswith("/v1/messages") else body


def _response(request: Request, err: APIError) -> JSONResponse:
    body = error_body(err.status, err.message, err.param, err.type)
    if request.url.path.startswith("/v1/messages"):
        body = {"type": "error", **body}
    return JSONResponse(body, status_code=err.status, headers=error_headers(err.status))


def as_api_error(exc: BaseException) -> APIError:
    """Map an engine or validation exception to the HTTP error it means."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloaded):
        return APIError(503, str(exc))
    if isinstance(exc, EngineStopped):
        return APIError(503, str(exc))
    if isinstance(exc, EngineError):
        return APIError(500, str(exc))
    if isinstance(exc, InvalidRequest | ChatTemplateError | InvalidText):
        return APIError(400, str(exc))
    if isinstance(exc, ValidationError):
        return validation_error(exc.errors(include_url=False))
    if isinstance(exc, InvalidParameter):
        return invalid_parameter(exc)
    logger.error("unexpected %s while serving a request", type(exc).__name__, exc_info=exc)
    return APIError(500, f"internal server error ({type(exc).__name__})")


def invalid_parameter(exc: InvalidParameter, names: dict[str, str] | None = None) -> APIError:
    """A 400 naming the field of a rejected engine parameter (a SamplingParams value).

    :param names: the request's name of an engine field, where they differ (Anthropic's
        ``stop_sequences`` for ``stop``).
    """
    field = (names or {}).get(exc.field, exc.field)
    return APIError(400, f"{field}: {exc.problem}", param=field)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple", "literal", "json-or-python"}


def _is_type_tag(part: Any) -> bool:
    """True for a ``loc`` part pydantic adds for a union member (``str``, ``list[int]``, ``TextPart``,
    ``function-after[...]``), which is no field of the user's request."""
    if isinstance(part, int):
        return False
    text = str(part)
    return text in _TYPE_TAGS or any(c in text for c in "[(-") or text[:1].isupper()


def field_path(loc: Any) -> str | None:
    """The user's field in a pydantic ``loc``: ``messages.0.content``, not ``body.messages.0.content.str``."""
    parts = [str(p) for p in loc if p != "body" and not _is_type_tag(p)]
    return ".".join(parts) or None


def _relevance(error: Any) -> int:
    # a union reports every member that failed; the one whose type matched but whose value did not
    # (a value error, a constraint) says what is wrong, a type mismatch of another member does not
    kind = str(error.get("type", ""))
    if kind.endswith("_type") or kind in ("model_attributes_type", "union_tag_invalid", "is_instance_of"):
        return 1
    return 0


def validation_error(errors: Any) -> APIError:
    """A 400 naming the most telling offending field of pydantic / FastAPI validation ``errors``."""
    errors = list(errors)
    if errors and errors[0].get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {errors[0].get('msg', '')}".rstrip(": "))
    # among equally telling errors, the deepest: the union member that matched the furthest
    best = min(errors, key=lambda e: (_relevance(e), -len(e.get("loc", ())))) if errors else {}
    param = field_path(best.get("loc", ()))
    message = str(best.get("msg", "invalid request")).removeprefix("Value error, ")
    others = {field_path(e.get("loc", ())) for e in errors} - {param}
    if others:
        message += f" (and {len(others)} more field(s): {', '.join(sorted(str(o) for o in others)[:3])})"
    return APIError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in the OpenAI shape: 422 validation errors become 400s naming the field."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _response(request, validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 400 and "parsing the body" in message:
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, RecursionError):
                message = "the request body is nested too deeply to parse"
            else:
                message = "the request body could not be read: it must be UTF-8 encoded JSON"
        return _response(request, APIError(exc.status_code, message))

    async def _known(request: Request, exc: Exception) -> JSONResponse:
        return _response(request, as_api_error(exc))

    # registered one by one: these are answered like APIError, while the catch-all below (Starlette's
    # server-error middleware) also re-raises, so uvicorn logs the traceback of a real bug
    known_errors = (InvalidRequest, ChatTemplateError, InvalidText, ValidationError, InvalidParameter)
    for known in (*known_errors, EngineOverloaded, EngineError):
        app.add_exception_handler(known, _known)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return _response(request, as_api_error(exc))
