"""``/openapi.json`` as the server behaves: validation errors are 400s in the OpenAI error shape (the
error handlers turn FastAPI's 422 into them), streaming routes answer ``text/event-stream``, and
every route lists the errors it can give (401, 413, 503 from the gate and the key check)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "type": {"type": "string", "enum": ["error"], "description": "on /v1/messages only (Anthropic's shape)"},
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "examples": ["invalid_request_error"]},
                "param": {"type": ["string", "null"], "description": "the request field at fault"},
                "code": {"type": "integer"},
            },
        },
    },
}
_ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}

#: the ``responses`` of every route that takes a request body or the API key
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "invalid request (names the field in error.param)", "content": _ERROR_CONTENT},
    401: {"description": "missing or wrong API key", "content": _ERROR_CONTENT},
    404: {"description": "unknown model", "content": _ERROR_CONTENT},
    413: {"description": "request body over --max-request-bytes", "content": _ERROR_CONTENT},
    503: {"description": "overloaded or shutting down (see Retry-After)", "content": _ERROR_CONTENT},
}
#: routes that stream server-sent events when the body says ``"stream": true``
_STREAMING = ("/v1/completions", "/v1/chat/completions", "/v1/messages")


def describe(app: FastAPI) -> None:
    """Make ``app.openapi()`` describe the server as it behaves (see the module docstring)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes, description=_DESCRIPTION)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components["ErrorResponse"] = _ERROR_SCHEMA
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for path, item in schema.get("paths", {}).items():
            for op in item.values():
                responses = op.get("responses", {})
                responses.pop("422", None)
                ok = responses.get("200")
                if path in _STREAMING and ok is not None:
                    ok.setdefault("content", {})["text/event-stream"] = {
                        "schema": {"type": "string", "description": 'server-sent events, with "stream": true'}
                    }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


_DESCRIPTION = (
    "OpenAI-compatible (/v1/completions, /v1/chat/completions, /v1/embeddings, /v1/models) and Anthropic-compatible "
    '(/v1/messages) inference server. Errors use the OpenAI shape; with "stream": true the generation '
    "routes answer server-sent events, and an error after the stream started is sent in-band before "
    "the terminator."
)
