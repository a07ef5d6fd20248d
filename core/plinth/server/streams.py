"""Plumbing between engine output streams and HTTP responses: priming, merging, collecting, deltas.

A request with several prompts runs one engine request per prompt; their streams are merged. Every
helper closes the streams it was given on the way out (normal end, error or cancellation), and
closing a stream aborts its engine request, so no path leaves KV blocks behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from plinth.runtime.outputs import CompletionOutput, RequestOutput, TokenLogprob
from plinth.server.errors import as_api_error

T = TypeVar("T")
Streams = dict[int, AsyncGenerator[RequestOutput, None]]


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    """One server-sent event (``data: ...\\n\\n``, preceded by ``event: ...`` when named)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


async def close_all(streams: Iterable[AsyncIterator[Any]]) -> None:
    """Close every stream (aborting the unfinished engine requests behind them)."""
    for stream in streams:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


async def start_streams(streams: Streams) -> dict[int, RequestOutput]:
    """Wait for the first output of every stream, so a refused request is an HTTP error, not an event.

    :raises APIError: some stream failed (all of them are closed then).
    """
    keys = list(streams)
    try:
        results = await asyncio.gather(*(anext(streams[k]) for k in keys), return_exceptions=True)
    except BaseException:
        await close_all(streams.values())
        raise
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_all(streams.values())
        raise as_api_error(errors[0])
    return {k: r for k, r in zip(keys, results, strict=True) if isinstance(r, RequestOutput)}


async def merge(firsts: dict[int, RequestOutput], streams: Streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(key, output)`` from the primed streams in arrival order, their first outputs first."""
    for key, first in firsts.items():
        yield key, first
    live = {k: s for k, s in streams.items() if not firsts[k].finished}
    if len(live) == 1:  # the common case: no tasks needed
        [(key, stream)] = live.items()
        async for out in stream:
            yield key, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(key: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((key, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((key, exc))
        finally:
            queue.put_nowait((key, None))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in live.items()]
    try:
        remaining = len(tasks)
        while remaining:
            key, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield key, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    last: RequestOutput | None = None
    async for out in stream:
        last = out
    assert last is not None and last.finished, "an engine stream ends with a finished output"
    return last


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it (which aborts its engine requests) if the client disconnects.

    :raises ClientDisconnected: the client went away first.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled ourselves (shutdown): take the work down with us
        task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        raise
    watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected()


async def collect(request: Request, streams: Streams) -> dict[int, RequestOutput]:
    """The final output of every stream, run concurrently; aborted if the client disconnects.

    :raises APIError: some stream failed (the others are closed).
    """

    async def run() -> dict[int, RequestOutput]:
        keys = list(streams)
        results = await asyncio.gather(*(_last(streams[k]) for k in keys), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise as_api_error(errors[0])
        return {k: r for k, r in zip(keys, results, strict=True) if isinstance(r, RequestOutput)}

    try:
        return await until_disconnect(request, run())
    finally:
        await close_all(streams.values())


@dataclass(slots=True)
class Delta:
    """What one completion added since the previous chunk."""

    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None


@dataclass(slots=True)
class ChoiceCursor:
    """How much of one completion was already streamed.

    Text that could still be the start of a stop string (a suffix of the text that is a prefix of
    one) is held back until the completion moves past it; the engine finds a stop string only once
    it is whole, then cuts the text before it, so what was streamed is always a prefix of the final
    text. Text that cannot begin a stop string is sent at once, however long the stop strings are.
    """

    stops: list[str] = field(default_factory=list)
    chars: int = 0
    tokens: int = 0
    logprobs: int = 0
    finished: bool = False

    def advance(self, c: CompletionOutput) -> Delta | None:
        """The delta of ``c`` since the last call; None when there is nothing new to send."""
        if self.finished:
            return None
        end = len(c.text) if c.finished else max(self.chars, len(c.text) - partial_stop(c.text, self.stops))
        text = c.text[self.chars : end]
        self.chars = max(self.chars, end)
        self.tokens = len(c.token_ids)
        new_lps = c.logprobs[self.logprobs :] if c.logprobs is not None else []
        self.logprobs += len(new_lps)
        self.finished = c.finished
        if not text and not new_lps and not c.finished:
            return None
        return Delta(text, new_lps, c.finish_reason)


def partial_stop(text: str, stops: list[str]) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of one of ``stops``.

    Runs for every chunk of every stream, on the event loop: only the prefix lengths ``k`` whose last
    character is the text's last character are compared (found with ``rfind``), not every ``k``."""
    if not text:
        return 0
    last = text[-1]
    best = 0
    for stop in stops:
        # a prefix stop[:k] can end the text only if stop[k - 1] == last; try the longest first
        i = stop.rfind(last, 0, min(len(stop) - 1, len(text)))
        while i >= best:
            if text.endswith(stop[: i + 1]):
                best = i + 1
                break
            i = stop.rfind(last, 0, i)
    return best
