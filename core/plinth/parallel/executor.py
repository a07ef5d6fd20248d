"""Tensor-parallel executor: worker processes started and supervised by rank 0 (the engine).

Rank 0 holds the scheduler and the sampler. It starts ranks 1..N-1 as processes (``spawn``), all
join one ``torch.distributed`` world over TCP on the loopback, and each step rank 0 broadcasts the
scheduler's output (its value objects, pickled) over the CPU control group; every rank then runs
the same forward on its shard in lockstep (the model's collectives run on the backend's device
group), and rank 0 samples.

Failure: every collective has a timeout (``EngineConfig.distributed_timeout_s``). Before each step
rank 0 checks that every worker is still running, so one that died between steps fails the step at
once (a gloo send to a peer that is gone can otherwise wait for the whole timeout: CI saw 60 s); one
that dies inside a step closes its sockets, which usually fails the collective at once, and one that
hangs fails it at the timeout. Either way rank 0 raises :class:`WorkerFailure`, naming each dead rank and the error it
reported, and never waits forever. A worker whose start fails reports its error the same way.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plinth.config import EngineConfig
from plinth.parallel.comm import (
    START_TIMEOUT_S,
    CollectiveError,
    broadcast_object,
    close_world,
    gather_object,
    init_world,
)

logger = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died, hung or failed to start; the message names it and its error."""


@dataclass(frozen=True, slots=True)
class RankMemory:
    """What one rank can give the KV cache, sent to rank 0 before it sizes the cache (every rank
    allocates the same number of blocks, so the rank with the least room decides).

    :param host: this boot of this machine (ranks with the same ``host`` and ``device`` share memory).
    :param device: the rank's device, as text.
    :param free_bytes: the device's free memory once the rank's weights are loaded.
    :param block_bytes: bytes of one KV block over this rank's layers and heads (pipeline stages differ).
    """

    host: str
    device: str
    free_bytes: int
    block_bytes: int


def host_identity() -> str:
    """This boot of this machine: the kernel's boot id where there is one, else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


@dataclass(frozen=True, slots=True)
class WorkerSetup:
    """What rank 0 decided at start-up and every worker must use: the KV cache and its blocks."""

    num_blocks: int
    block_size: int
    dtype: str
    kv_cache_dtype: str


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host``'s interface (the loopback by default), for the world's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def join_world_as_rank0(init_method: str, world_size: int, timeout_s: float, gone: Callable[[], bool]) -> str | None:
    """Rank 0's rendezvous, watching the workers: returns None once the world formed, else why not.

    ``gone()`` is polled while rank 0 waits; a worker that is gone (it exited, or its actor died)
    fails the start at once instead of at the timeout. The caller kills the workers and names them.
    """
    failure: list[BaseException] = []

    def join() -> None:
        try:
            init_world(init_method, world_size, 0, timeout_s)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            failure.append(e)

    thread = threading.Thread(target=join, name="plinth-tp-rendezvous", daemon=True)
    thread.start()
    deadline = time.monotonic() + max(timeout_s, START_TIMEOUT_S) + 5
    while thread.is_alive():
        thread.join(timeout=0.2)
        if gone() or time.monotonic() > deadline:
            return "the tensor-parallel group did not form"
    if failure:
        return f"the tensor-parallel group did not form: {failure[0]}"
    return None


def default_threads(world_size: int) -> int:
    """Host threads per rank when the user named none: the cores shared out, at least 1."""
    return max(1, (os.cpu_count() or 1) // world_size)


class Executor(ABC):
    """What the engine needs of the workers' keeper, however they were started (processes, Ray)."""

    #: the device index reserved for rank 0 (Ray, for a backend with a ``device_resource``); None:
    #: rank 0 takes its index among the ranks on its host
    local_rank: int | None = None

    def broadcast(self, obj: Any) -> None:
        """Send one step (or, ``None``, the end) to every worker.

        :raises WorkerFailure: a rank is gone or the broadcast timed out (named by :meth:`diagnose`).
        """
        if not self.alive():  # a dead peer's socket does not always fail gloo's send at once
            raise WorkerFailure(self.diagnose("a worker is gone before the step"))
        try:
            broadcast_object(obj)
        except CollectiveError as e:
            raise WorkerFailure(self.diagnose(str(e))) from e

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (rank 0's first), sent once at start-up (each rank's :class:`RankMemory`).

        :raises WorkerFailure: a rank is gone or the gather timed out.
        """
        try:
            got = gather_object(obj)
        except CollectiveError as e:
            raise WorkerFailure(self.diagnose(str(e))) from e
        assert got is not None  # rank 0 is the destination
        return got

    @abstractmethod
    def diagnose(self, what: str) -> str:
        """``what``, with every rank that is gone and why."""

    @abstractmethod
    def alive(self) -> bool:
        """Whether every worker is still in its loop."""

    @abstractmethod
    def close(self) -> None:
        """Stop the workers (bounded in time, idempotent)."""


def make_executor(config: EngineConfig, world_size: int) -> Executor:
    """The executor ``config.distributed_executor`` names: local processes ("mp") or Ray actors ("ray")."""
    executor: Executor
    if config.distributed_executor == "ray":
        from plinth.parallel.ray_executor import RayExecutor

        executor = RayExecutor(config, world_size)
    else:
        executor = MultiprocExecutor(config, world_size)
    atexit.register(executor.close)  # a script that never closes its engine still ends its workers cleanly
    return executor


class MultiprocExecutor(Executor):
    """Ranks 1..N-1 as local processes (``python -m plinth.parallel.executor``); rank 0 is the caller.

    Workers are started as fresh interpreters, not forked or spawned from the caller's main module,
    so a user's script needs no ``if __name__ == "__main__"`` guard. Each reports a fatal error to a
    file rank 0 reads when it names the failure.

    :param config: the engine's config (each worker builds its shard from it).
    :param world_size: the tensor-parallel size N.
    """

    def __init__(self, config: EngineConfig, world_size: int) -> None:
        self.world_size = world_size
        self.timeout_s = config.distributed_timeout_s
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self._dir = tempfile.TemporaryDirectory(prefix="plinth-tp-")
        config_path = os.path.join(self._dir.name, "config.pkl")
        with open(config_path, "wb") as f:
            pickle.dump(config, f)
        self.workers: list[subprocess.Popen[bytes]] = []
        for rank in range(1, world_size):
            cmd = [
                sys.executable, "-m", "plinth.parallel.executor", "--rank", str(rank), "--world-size",
                str(world_size), "--init-method", self.init_method, "--config", config_path,
                "--report", self._report(rank),
            ]  # fmt: skip
            self.workers.append(subprocess.Popen(cmd))
        self.closed = False
        self._join_world()

    def _report(self, rank: int) -> str:
        return os.path.join(self._dir.name, f"rank{rank}.error")

    def _join_world(self) -> None:
        """Rank 0's rendezvous, watching the workers: one that exits first fails the start at once."""

        def exited() -> bool:
            return any(p.poll() not in (None, 0) for p in self.workers)

        why = join_world_as_rank0(self.init_method, self.world_size, self.timeout_s, exited)
        if why is not None:
            self.kill()
            raise WorkerFailure(self.diagnose(why))

    def diagnose(self, what: str) -> str:
        """``what``, with every rank that is gone and the error it reported.

        A peer's socket can close a moment before its process is reaped: when every worker still
        looks alive, this waits up to 2 s for one to exit, so the message names it.
        """
        deadline = time.monotonic() + 2.0
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        parts = [what]
        for rank, proc in enumerate(self.workers, start=1):
            try:
                with open(self._report(rank), encoding="utf-8") as f:
                    report = f.read().strip()
            except OSError:
                report = ""
            if report:
                parts.append(f"rank {rank}: {report}")
            elif proc.poll() is not None:
                parts.append(f"rank {rank}: exited with code {proc.returncode}")
        return "; ".join(parts)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.workers)

    def kill(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.kill()
        for proc in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)

    def close(self) -> None:
        """Tell the workers to stop, wait for them (a bounded time), leave the world."""
        if self.closed:
            return
        self.closed = True
        if self.alive():
            with contextlib.suppress(CollectiveError):
                broadcast_object(None)
        for proc in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.kill()
        close_world()
        self._dir.cleanup()


def worker_main(config: EngineConfig, rank: int, world_size: int, init_method: str, report: str) -> int:
    """A worker rank: join the world, load the shard, then run each broadcast step until ``None``.

    Returns the exit status; a fatal error is written to ``report`` (for rank 0) and to stderr.
    """
    try:
        worker_loop(config, rank, world_size, init_method)
    except BaseException as e:  # noqa: BLE001 - report, then exit non-zero: rank 0 names it
        with open(report, "w", encoding="utf-8") as f:
            f.write(f"{type(e).__name__}: {e}")
        traceback.print_exc()
        close_world()
        return 1
    close_world()
    return 0


def worker_loop(
    config: EngineConfig, rank: int, world_size: int, init_method: str, local_rank: int | None = None
) -> None:
    """A worker rank's life, however it was started (a process here, a Ray actor): join the world,
    load the shard or stage (on device ``local_rank`` where its executor reserved one), then run
    each step rank 0 broadcasts until it sends ``None``."""
    import torch

    from plinth.runtime.lora import LoRAEvict, LoRAPlace
    from plinth.runtime.worker import build_worker

    init_world(init_method, world_size, rank, config.distributed_timeout_s)
    torch.set_num_threads(config.num_threads or default_threads(world_size))
    runner = build_worker(config, rank, world_size, local_rank)
    while True:
        step = broadcast_object(None)
        if step is None:
            return
        if isinstance(step, LoRAPlace | LoRAEvict):  # between two steps: an adapter decision of rank 0
            if runner.lora is None:
                raise RuntimeError(f"rank {rank}: a LoRA decision reached a worker without LoRA slots")
            runner.lora.apply(step)
            continue
        runner.execute(step)


def main(argv: list[str] | None = None) -> int:
    """``python -m plinth.parallel.executor``: one worker rank (started by rank 0, not by hand)."""
    parser = argparse.ArgumentParser(prog="python -m plinth.parallel.executor", description=main.__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--config", required=True, help="the engine config, pickled by rank 0")
    parser.add_argument("--report", required=True, help="where a fatal error is written for rank 0")
    args = parser.parse_args(argv)
    with open(args.config, "rb") as f:
        config = pickle.load(f)  # written by rank 0 of this very group, in a private temp dir
    return worker_main(config, args.rank, args.world_size, args.init_method, args.report)


if __name__ == "__main__":
    raise SystemExit(main())
