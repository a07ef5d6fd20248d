"""Graceful shutdown (SIGTERM / SIGINT) that loses nothing silently.

1. The first signal starts the drain: from then on the request gate answers every new request
   but ``/health``, ``/version`` and ``/metrics`` with a JSON 503 and ``Retry-After``, and
   ``/health`` answers 503. The server keeps listening, so a client gets that answer rather
   than a refused connection.
2. Requests in flight get ``--drain-timeout`` seconds to finish.
3. At the deadline (or at a second signal; a third one stops at once) the engine aborts what is left with
   :class:`EngineStopped`: every open stream sends an in-band error event and its terminator
   (``data: [DONE]``; Anthropic's ``error`` then ``message_stop``), every waiting non-streaming
   request gets a JSON 503. Those responses get a few seconds to be written.
4. Then uvicorn closes the connections and the app's lifespan stops the engine thread. The exit
   status says whether everything drained: 0 when it did, 1 when requests were cut.

uvicorn's own graceful shutdown (cancelling the request tasks at its timeout, which cut streams
mid-chunk and logged one CancelledError per request) is only a backstop behind this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from plinth.server.state import ServerState

logger = logging.getLogger(__name__)

_POLL_S = 0.05
#: how long the responses of cut requests get to write their error events and terminators
CUT_GRACE_S = 5.0


class Drain:
    """The shutdown sequence of one server.

    :param state: the server state (its gate and engine).
    :param timeout: seconds in-flight requests get to finish.
    :param exit: called once the drain is over (tells uvicorn to close).
    """

    def __init__(self, state: ServerState, timeout: float, exit: Callable[[], None]) -> None:
        self.state = state
        self.timeout = max(timeout, 0.0)
        self._exit = exit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._cut_now: asyncio.Event | None = None
        self.started_at: float | None = None
        #: None while serving; then True when every request finished, False when some were cut
        self.clean: bool | None = None
        self.num_cut = 0

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Remember the loop the server runs on (called at start-up, on that loop)."""
        self._loop = loop

    def signal(self) -> None:
        """A shutdown signal arrived; safe from a signal handler. The first one starts the drain, a
        second one cuts the requests in flight at once."""
        loop = self._loop
        if loop is None or loop.is_closed():  # not serving yet: nothing to drain
            self._exit()
            return
        loop.call_soon_threadsafe(self._on_signal)

    def _on_signal(self) -> None:
        if self._task is None:
            self._cut_now = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self.run())
        elif self._cut_now is not None:
            logger.warning("second shutdown signal: ending the requests in flight now")
            self._cut_now.set()

    async def run(self) -> None:
        """Drain, cut at the deadline, then exit (see the module docstring)."""
        st = self.state
        st.draining = True
        self.started_at = time.monotonic()
        cut_now = self._cut_now or asyncio.Event()
        busy = st.in_flight
        if busy:
            logger.warning("shutting down: %d request(s) in flight get %.1f s to finish", busy, self.timeout)
        deadline = self.started_at + self.timeout
        while st.in_flight and time.monotonic() < deadline and not cut_now.is_set():
            await _wait(cut_now, min(_POLL_S, max(deadline - time.monotonic(), 0.0)))
        self.clean = st.in_flight == 0
        if not self.clean:
            try:
                # bounded: an engine thread stuck in a long step (or dead) must not hold the exit
                self.num_cut = await asyncio.wait_for(
                    st.engine.abort_all("the server shut down before the request finished"), CUT_GRACE_S
                )
            except TimeoutError:
                logger.error("the engine did not take the abort within %.1f s: exiting without it", CUT_GRACE_S)
            logger.warning(
                "drain timeout: %d request(s) still in flight, %d engine request(s) ended with an error",
                st.in_flight,
                self.num_cut,
            )
            grace = time.monotonic() + CUT_GRACE_S
            while st.in_flight and time.monotonic() < grace:
                await asyncio.sleep(_POLL_S)
        self._exit()

    @property
    def exit_code(self) -> int:
        """0 after a clean drain (or none), 1 when requests were cut."""
        return 1 if self.clean is False else 0


async def _wait(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with SIGTERM / SIGINT handed to a :class:`Drain` instead of uvicorn's own
    shutdown (which cancels the request tasks at its timeout: streams cut mid-chunk)."""

    drain: Drain | None = None
    _signals = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal: the first starts the drain, the second cuts the requests in flight, a third
        stops without waiting for anything (uvicorn's force exit)."""
        # not recorded in _captured_signals: uvicorn would re-raise it after the shutdown, and the
        # default disposition of SIGTERM would then kill the process with -15
        self._signals += 1
        if self.drain is None or self._signals >= 3:
            self.force_exit = self._signals >= 3
            self.should_exit = True
            if self.drain is not None and self.drain.clean is None:
                self.drain.clean = False  # nothing was waited for: say so in the exit status
        else:
            self.drain.signal()

    def exit_now(self) -> None:
        """End the main loop: uvicorn closes the connections and runs the lifespan shutdown."""
        self.should_exit = True
