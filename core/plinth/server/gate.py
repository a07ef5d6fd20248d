"""The request gate: ASGI middleware in front of every route.

It refuses, before any route runs and before the body is parsed:

- a body over ``--max-request-bytes`` (413 in the OpenAI error shape); a declared ``Content-Length``
  over it is refused before the body is parsed (what arrives is read and dropped, up to
  ``_DISCARD_FACTOR`` times the limit, so the client reads the 413), a chunked body is counted as it
  arrives;
- any request but ``/health``, ``/version`` and ``/metrics`` while the server drains for shutdown
  (503 with ``Retry-After``), so a balancer sends it elsewhere.

It also counts the requests in flight, which is what the drain waits for (:mod:`plinth.server.drain`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plinth.server.errors import error_headers, error_json
from plinth.server.state import ServerState

#: routes a draining server still answers (health checks and scrapers see the drain happen)
ALWAYS_OPEN = frozenset({"/health", "/version", "/metrics"})
#: an oversized body is read and dropped before the 413 (closing on unread data makes the kernel reset
#: the connection, and the client sees a broken pipe instead of the 413), up to this many times the limit
_DISCARD_FACTOR = 8


async def send_error(send: Send, path: str, status: int, message: str, param: str | None = None) -> None:
    """Answer with an error in the route's shape, straight from ASGI (no route has run)."""
    body = json.dumps(error_json(path, status, message, param)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error_headers(status) or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGate:
    """ASGI middleware: body-size limit, refusal while draining, in-flight count.

    :param state: returns the server state (built after the app, so looked up per request).
    """

    def __init__(self, app: ASGIApp, state: Callable[[], ServerState]) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Gate one ASGI call (only HTTP requests; the lifespan passes through)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        st, path = self.state(), scope["path"]
        if st.draining and path not in ALWAYS_OPEN:
            await send_error(send, path, 503, "the server is shutting down; retry on another replica")
            st.metrics.count_http(path, scope["method"], 503)
            return
        status = 500  # what the client saw if the app never answered

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        st.in_flight += 1
        try:
            await self._limited(st, scope, receive, counted)
        finally:
            st.in_flight -= 1
            st.metrics.count_http(path, scope["method"], status)

    async def _limited(self, st: ServerState, scope: Scope, receive: Receive, send: Send) -> None:
        limit = st.settings.max_request_bytes
        path = scope["path"]
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _discard(receive, limit * _DISCARD_FACTOR)
            await send_error(send, path, 413, _too_large(f"{declared} bytes", limit))
            return
        if declared is not None or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)  # the server holds a declared length to its word
            return
        # no Content-Length (chunked): read it all here, counting, then hand the app a replay
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > limit:
                if more:
                    await _discard(receive, limit * _DISCARD_FACTOR)
                await send_error(send, path, 413, _too_large(f"over {limit} bytes", limit))
                return
            chunks.append(chunk)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect is left to wait for

        await self.app(scope, replay, send)


def _too_large(size: str, limit: int) -> str:
    return f"the request body is {size}; this server takes at most {limit} bytes (--max-request-bytes)"


def _content_length(scope: Scope) -> int | None:
    for key, value in scope["headers"]:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _discard(receive: Receive, budget: int) -> None:
    """Read and drop the body, up to ``budget`` bytes (past that the connection is simply closed)."""
    seen = 0
    while seen <= budget:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
