"""The asynchronous engine: one :class:`LLMEngine` stepped in a worker thread, many asyncio consumers.

The event loop never runs the model. The engine is touched only from its own thread:

- ``generate`` puts an add command on a thread-safe queue and awaits an asyncio queue of its own;
- the engine thread drains the commands (adds, aborts), runs ``engine.step()``, and hands each step's
  outputs back to the loop in ONE ``loop.call_soon_threadsafe`` call, which fans them out to the
  per-request queues;
- a consumer that stops listening (cancelled task, ``aclose``, a client gone) aborts its request on
  the way out, so its KV blocks return to the pool at the next iteration of the engine thread.

An exception inside ``engine.step`` fails the requests of that step with :class:`EngineError` (logged
with its traceback), the engine is cleaned, and the thread keeps serving new requests, unless the
engine says it cannot step again (``engine.fatal``: a tensor-parallel rank died or hung): then
every request in flight and queued fails with that error, the thread ends and ``on_fatal`` is called
(``plinth serve`` exits non-zero). Unless a restart was asked for (``plinth serve --restart-workers N``):
then, the requests failed the same way, the engine thread closes the broken engine (stopping its
workers), builds a new one (new workers, weights loaded again) and serves on with it; new requests
meanwhile get :class:`EngineRestarting` (HTTP 503 with Retry-After). A restart that fails, or a failure
after the last allowed restart, ends as above.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from plinth.pooling_params import PoolingParams
from plinth.runtime.engine import InvalidRequest
from plinth.runtime.outputs import RequestOutput
from plinth.sampling_params import SamplingParams

if TYPE_CHECKING:
    from plinth.runtime.engine import LLMEngine

logger = logging.getLogger(__name__)

T = TypeVar("T")

_IDLE_POLL_S = 0.5  # an idle engine thread wakes this often to notice a stop without a command


class EngineOverloaded(Exception):
    """The waiting queue is full: the request was refused without being queued (HTTP 503)."""


class EngineError(RuntimeError):
    """The engine failed while running this request; the request was aborted (HTTP 500)."""


class EngineStopped(EngineError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class EngineRestarting(EngineOverloaded):
    """A worker failed and the engine is being rebuilt: the request was refused, retry (HTTP 503)."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the scheduler, taken by the engine thread after each iteration."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    kv_waste: float = 0.0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    num_failed_steps_total: int = 0
    spec_num_drafts_total: int = 0  # speculative decoding: sequence-steps that carried drafts
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    num_restarts_total: int = 0  # engines rebuilt after a worker failed (--restart-workers)


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding request
    lora: str | None = None  # the LoRA adapter it runs with


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _AbortAll:
    """End every request with :class:`EngineStopped` (``reason``); the count goes to ``done``."""

    reason: str
    done: Callable[[int], None]


@dataclass(frozen=True, slots=True)
class _Call:
    """Run ``fn(engine)`` between steps (adapter loads); ``done`` gets the result or the exception."""

    fn: Callable[[LLMEngine], object]
    done: Callable[[object, BaseException | None], None]


class _Stop:
    """Sentinel command: abort what is left and end the engine thread."""


_STOP = _Stop()
_Item = RequestOutput | BaseException


class AsyncEngine:
    """Continuous batching for asyncio: ``async for out in engine.generate(id, prompt, params)``.

    :param engine: the engine to drive; after :meth:`start` only the engine thread may touch it.
    :param max_waiting: refuse a new request (:class:`EngineOverloaded`) while this many requests
        are queued but not yet running; None: unbounded.
    :param rebuild: builds a fresh engine (same config) after a fatal worker failure; None: never.
    :param max_restarts: how many times ``rebuild`` may be used before a failure is fatal.
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting: int | None = None,
        *,
        rebuild: Callable[[], LLMEngine] | None = None,
        max_restarts: int = 0,
    ) -> None:
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {max_waiting}")
        if max_restarts < 0 or (max_restarts and rebuild is None):
            raise ValueError(f"max_restarts must be >= 0 and needs rebuild, got {max_restarts}")
        self.engine = engine
        self.rebuild = rebuild
        self.max_restarts = max_restarts
        #: engines rebuilt so far; True while one is being built (new requests get EngineRestarting)
        self.num_restarts = 0
        self.restarting = False
        self.max_waiting = max_waiting
        self._commands: queue.SimpleQueue[_Add | _Abort | _AbortAll | _Call | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[_Item]] = {}  # touched on the loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = EngineStats()
        self._failed_steps = 0
        #: the error that stopped the engine for good (a tensor-parallel rank died); None while it serves
        self.fatal: BaseException | None = None
        #: called once, on the engine thread, with that error (the server exits non-zero)
        self.on_fatal: Callable[[BaseException], None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread; outputs are delivered to the running event loop."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="plinth-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort what is left (consumers get :class:`EngineStopped`) and join the engine thread."""
        self._stopping = True
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def abort_all(self, reason: str) -> int:
        """End every request now, each consumer getting :class:`EngineStopped` (``reason``), and
        refuse new ones: the drain's deadline. The number of engine requests ended."""
        self._stopping = True
        if self._thread is None or self._loop is None or not self._thread.is_alive():
            return 0  # no engine thread to take the command: nothing would ever resolve it
        loop = self._loop
        done: asyncio.Future[int] = loop.create_future()

        def settle(n: int) -> None:
            if not done.done():
                done.set_result(n)

        def resolve(n: int) -> None:  # called on the engine thread
            loop.call_soon_threadsafe(settle, n)

        self._commands.put(_AbortAll(reason, resolve))
        return await done

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)`` run on the engine thread between two steps (what changes the model's
        weights, as loading a LoRA adapter does); its exception is raised here.

        :raises EngineStopped: the engine thread is not running.
        """
        if self._stopping or self._thread is None or self._loop is None or not self._thread.is_alive():
            raise EngineStopped("the server is shutting down" if self._stopping else "the engine is not started")
        loop = self._loop
        done: asyncio.Future[T] = loop.create_future()

        def settle(result: object, error: BaseException | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)  # type: ignore[arg-type]

        def resolve(result: object, error: BaseException | None) -> None:  # on the engine thread
            loop.call_soon_threadsafe(settle, result, error)

        self._commands.put(_Call(fn, resolve))
        return await done

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and serving (the /health answer: not while restarting)."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping and not self.restarting

    @property
    def stats(self) -> EngineStats:
        """The latest scheduler snapshot (safe to read from any thread)."""
        return self._stats

    # -- the one core API ------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        lora: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue a request and yield its outputs as the engine advances it, the last one finished;
        ``lora`` names the LoRA adapter to run it with.

        With :class:`~plinth.pooling_params.PoolingParams` it is an embedding request: one output,
        finished, with ``embedding`` set.

        Leaving the iteration early (break, ``aclose``, cancellation) aborts the request.

        :raises InvalidRequest: the engine refused the request (raised by the first ``__anext__``).
        :raises EngineOverloaded: the waiting queue is full.
        :raises EngineError: the engine failed while running it.
        """
        if self._stopping or self._thread is None:
            raise EngineStopped("the server is shutting down" if self._stopping else "the engine is not started")
        if self.fatal is not None:
            raise EngineError(f"the engine stopped: {self.fatal}")
        if self.restarting:
            raise EngineRestarting("a worker failed and the engine is restarting; retry shortly")
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue[_Item] = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put(_Add(request_id, prompt, params, lora))
        done = False  # True once the engine no longer holds the request
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            del self._streams[request_id]
            if not done:
                self._commands.put(_Abort(request_id))

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            items: list[tuple[str, _Item]] = []
            stop = self._apply_commands(block=not engine.has_unfinished(), items=items)
            if stop:
                for rid in engine.abort_all():
                    items.append((rid, EngineStopped("the server shut down before the request finished")))
                self._deliver(items)
                self._snapshot()
                return
            if engine.has_unfinished():
                try:
                    for out in engine.step():
                        # the engine keeps mutating its metrics object: hand the loop a copy
                        out.metrics = dataclasses.replace(out.metrics)
                        items.append((out.request_id, out))
                except Exception as exc:  # noqa: BLE001 - a failed step must not kill the loop
                    self._failed_steps += 1
                    aborted = engine.abort_all()
                    logger.exception("engine step failed; aborted %d request(s): %s", len(aborted), aborted)
                    error = EngineError(f"the engine failed while running this request ({type(exc).__name__})")
                    if getattr(engine, "fatal", None) is not None:  # it cannot step again
                        error = EngineError(f"the engine stopped: {exc}")
                        items.extend((rid, error) for rid in aborted)
                        self._deliver(items)
                        self._fail_commands(error)
                        if self._restart(exc):
                            engine = self.engine
                            continue
                        self.fatal = exc  # end, loudly
                        if self.on_fatal is not None:
                            self.on_fatal(exc)
                        return
                    items.extend((rid, error) for rid in aborted)
            self._deliver(items)
            self._snapshot()

    def _restart(self, cause: BaseException) -> bool:
        """Replace the broken engine with a fresh one, if a restart is left; True when serving again.

        Runs on the engine thread, which is the only one touching the engine; requests arriving
        meanwhile are refused (:class:`EngineRestarting`), so none waits on a rebuild that may fail.
        """
        if self.rebuild is None or self.num_restarts >= self.max_restarts or self._stopping:
            return False
        self.restarting = True
        self.num_restarts += 1
        logger.error("restarting the engine (%d of %d) after: %s", self.num_restarts, self.max_restarts, cause)
        # the adapters loaded when it failed, --lora's and those loaded at run time (in load order)
        lora = self.engine.lora
        adapters = [(name, adapter.path) for name in lora.names() if (adapter := lora.get(name))] if lora else []
        try:
            try:
                self.engine.close()  # its workers: the dead one reaped, the others stopped
            except Exception:  # noqa: BLE001 - a broken engine may fail to close; the rebuild decides
                logger.exception("closing the failed engine raised")
            self.engine = self.rebuild()
            self._reload_adapters(adapters)
        except Exception:  # noqa: BLE001 - the restart failed: the original failure stays the cause
            logger.exception("the engine restart failed")
            return False
        finally:
            self.restarting = False
        logger.error("the engine restarted (%d of %d)", self.num_restarts, self.max_restarts)
        self._snapshot()
        return True

    def _reload_adapters(self, adapters: list[tuple[str, str]]) -> None:
        """Load into the rebuilt engine the adapters the failed one had that it has not (the rebuild
        loads ``--lora``'s; those loaded at run time come back here). One that no longer loads is
        logged and left out: the server serves the rest."""
        loaded = set(self.engine.list_loras())
        for name, path in adapters:
            if name in loaded:
                continue
            try:
                self.engine.add_lora(name, path)
            except Exception as e:  # noqa: BLE001 - one adapter's folder may be gone; the others still serve
                logger.error("after the restart, LoRA adapter %r (%s) did not load again: %s", name, path, e)

    def _apply_commands(self, block: bool, items: list[tuple[str, _Item]]) -> bool:
        """Apply every queued command (waiting for one when ``block``); True when asked to stop."""
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        engine = self.engine
        while True:
            if isinstance(command, _Stop):
                return True
            if isinstance(command, _Abort):
                engine.abort_request(command.request_id)
            elif isinstance(command, _AbortAll):
                aborted = engine.abort_all()
                items.extend((rid, EngineStopped(command.reason)) for rid in aborted)
                command.done(len(aborted))
            elif isinstance(command, _Call):
                try:
                    result = command.fn(engine)
                except Exception as exc:  # noqa: BLE001 - handed to the caller, the loop keeps serving
                    command.done(None, exc)
                else:
                    command.done(result, None)
            else:
                error = self._add(command)
                if error is not None:
                    items.append((command.request_id, error))
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return False

    def _add(self, command: _Add) -> BaseException | None:
        """Add a request to the engine; the exception to hand its consumer when refused."""
        engine = self.engine
        if self.max_waiting is not None and engine.scheduler.num_waiting >= self.max_waiting:
            return EngineOverloaded(
                f"the server is overloaded: {engine.scheduler.num_waiting} requests are waiting "
                f"(--max-waiting {self.max_waiting}); retry later"
            )
        try:
            if isinstance(command.params, PoolingParams):
                engine.add_embedding_request(command.request_id, command.prompt, command.params)
            else:
                engine.add_request(command.request_id, command.prompt, command.params, lora=command.lora)
        except InvalidRequest as exc:
            return exc  # refused before anything was queued
        except ValueError as exc:  # the scheduler refused it after the engine registered it
            engine.abort_request(command.request_id)
            return InvalidRequest(str(exc))
        except Exception as exc:  # noqa: BLE001 - one bad request must not kill the loop
            engine.abort_request(command.request_id)
            logger.exception("adding request %s failed", command.request_id)
            return EngineError(f"the engine could not add this request ({type(exc).__name__})")
        return None

    def _fail_commands(self, error: BaseException) -> None:
        """Answer every request still queued as a command with ``error`` (the engine thread is ending)."""
        items: list[tuple[str, _Item]] = []
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                items.append((command.request_id, error))
            elif isinstance(command, _AbortAll):
                command.done(0)
            elif isinstance(command, _Call):
                command.done(None, error)
        self._deliver(items)

    def _deliver(self, items: list[tuple[str, _Item]]) -> None:
        if not items or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._fan_out, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            logger.debug("event loop closed; %d output(s) dropped", len(items))

    def _fan_out(self, items: list[tuple[str, _Item]]) -> None:
        """On the loop thread: put each output on its request's queue (gone when it was aborted)."""
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(item)

    def _snapshot(self) -> None:
        s = self.engine.scheduler
        self._stats = EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_usage=s.kv_usage,
            kv_waste=s.kv_waste,
            num_preemptions_total=s.num_preemptions_total,
            prefix_cache_queries_total=s.prefix_cache_query_tokens,
            prefix_cache_hits_total=s.prefix_cache_hit_tokens,
            num_failed_steps_total=self._failed_steps,
            spec_num_drafts_total=s.spec_stats.num_drafts,
            spec_num_draft_tokens_total=s.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens_total=s.spec_stats.num_accepted_tokens,
            num_restarts_total=self.num_restarts,
        )
