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

from plinth.model.tokenizer import ChatTemplateError
from plinth.runtime.engine import InvalidRequest
from plinth.server.async_engine import EngineError, EngineOverloaded, EngineStopped
from plinth.validation import InvalidParameter

logger = logging.getLogger(__name__)

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
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str, param: str | None = None, type_: str | None = None) -> dict[str, Any]:
    """The JSON body of an error (without the Anthropic ``"type": "error"`` marker)."""
    err = APIError(status, message, param, type_)
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}}


def _response(request: Request, err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    body = error_body(err.status, err.message, err.param, err.type)
    if request.url.path.startswith("/v1/messages"):
        body = {"type": "error", **body}
    return JSONResponse(body, status_code=err.status, headers=headers)


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
    if isinstance(exc, InvalidRequest | ChatTemplateError):
        return APIError(400, str(exc))
    if isinstance(exc, ValidationError):
        return validation_error(exc.errors(include_url=False))
    if isinstance(exc, InvalidParameter):
        return invalid_parameter(exc)
    logger.error("unexpected %s while serving a request", type(exc).__name__, exc_info=exc)
    return APIError(500, f"internal server error ({type(exc).__name__})")


def invalid_parameter(exc: InvalidParameter) -> APIError:
    """A 400 naming the field of a rejected engine parameter (a SamplingParams value)."""
    return APIError(400, f"{exc.field}: {exc.problem}", param=exc.field)


def validation_error(errors: Any) -> APIError:
    """A 400 naming the first offending field of pydantic / FastAPI validation ``errors``."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg', '')}".rstrip(": "))
    message = str(first.get("msg", "invalid request"))
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return APIError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in the OpenAI shape: 422 validation errors become 400s naming the field."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return _response(request, exc, headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _response(request, validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 400 and "parsing the body" in message:
            message = "the request body could not be read: it must be UTF-8 encoded JSON"
        return _response(request, APIError(exc.status_code, message))

    async def _known(request: Request, exc: Exception) -> JSONResponse:
        return _response(request, as_api_error(exc))

    # registered one by one: these are answered like APIError, while the catch-all below (Starlette's
    # server-error middleware) also re-raises, so uvicorn logs the traceback of a real bug
    for known in (InvalidRequest, ChatTemplateError, ValidationError, InvalidParameter, EngineOverloaded, EngineError):
        app.add_exception_handler(known, _known)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return _response(request, as_api_error(exc))
