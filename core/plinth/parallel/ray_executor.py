"""Tensor parallelism across machines: ranks 1..N-1 as Ray actors on an existing Ray cluster.

Rank 0 stays the engine process (the Ray driver: scheduler, sampler, tokenizer). It connects to a
running cluster (``$RAY_ADDRESS``, else ``"auto"``: the cluster this machine's ``ray start`` joined;
it never starts one), reserves a placement group of N-1 bundles (``{"CPU": num_threads or 1}``,
plus ``$PLINTH_RAY_RESOURCES``), and starts one actor per worker rank in it. Each actor runs the
very loop a worker process runs (:func:`plinth.parallel.executor.worker_loop`): it joins the
``torch.distributed`` world at ``tcp://<rank 0's node IP>:<free port>``, loads its shard and runs
each broadcast step. The model's collectives never pass through Ray: Ray only places and watches
the ranks.

Failure is found as for worker processes: a dead actor's sockets close, so rank 0's next collective
fails (a hung one at ``distributed_timeout_s``), and :meth:`RayExecutor.diagnose` names the rank
and, where Ray knows it, why the actor died. The actors share the driver's fate: if the engine
process dies, Ray kills them.

Environment (read once, when the executor starts):

- ``RAY_ADDRESS``: the cluster to join (``<head IP>:6379``); unset: ``"auto"``.
- ``PLINTH_RAY_PLACEMENT``: ``SPREAD`` (the default: ranks on different nodes where possible),
  ``PACK`` or ``STRICT_SPREAD`` (one rank per node, or fail).
- ``PLINTH_RAY_DEVICE``: the Ray resource one rank's device is counted as; default: the backend's
  ``Capabilities.device_resource`` (``GPU`` for the cuda and rocm backends on hardware; none for the
  CPU backends). With one, each rank reserves one: the workers' bundles, and a bundle for rank 0 on
  the driver's node (held by a small actor, so Ray gives no worker rank 0's device); each worker
  binds the one device Ray shows it, rank 0 the index Ray gave its holder. Empty: none.
- ``PLINTH_RAY_RESOURCES``: JSON of extra custom resources each worker bundle asks for, e.g.
  ``{"plinth_worker": 1}`` to keep workers on the nodes started with that resource (Ray does not
  count the driver's own use of its machine, so SPREAD alone may put a worker beside rank 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from plinth.config import EngineConfig
from plinth.parallel.comm import CollectiveError, broadcast_object, close_world
from plinth.parallel.executor import Executor, WorkerFailure, free_port, join_world_as_rank0, worker_loop
from plinth.platform.devices import HOST_COLLECTIVES_INTERFACE_ENV

logger = logging.getLogger(__name__)

PLACEMENT_ENV = "PLINTH_RAY_PLACEMENT"
RESOURCES_ENV = "PLINTH_RAY_RESOURCES"
DEVICE_ENV = "PLINTH_RAY_DEVICE"
STRATEGIES = ("SPREAD", "PACK", "STRICT_SPREAD")
#: Ray's resource name for a node's host cores (a bundle's size; nothing to do with any backend).
HOST_CORES = "CPU"
#: the least time an actor gets to start: a process, Ray's and torch's imports (``distributed_timeout_s``
#: bounds a collective, which this is not)
ACTOR_START_S = 60.0
#: how long ``close()`` waits for the actors to leave their loop before killing them
CLOSE_WAIT_S = 10.0
#: how long :meth:`RayExecutor.diagnose` gives Ray to learn of an actor's death the world already saw
DIAGNOSE_WAIT_S = 2.0  # as long as the process executor gives a worker to be reaped

_HOW_TO_START = (
    "start one with `ray start --head` on this machine (and `ray start --address=<head IP>:6379` on each "
    "other machine), or set RAY_ADDRESS to a running cluster's <head IP>:<port>"
)


class RayClusterError(WorkerFailure):
    """Ray is missing, no cluster is running, or the cluster cannot place the ranks; says the fix."""


@dataclass(frozen=True, slots=True)
class RayNode:
    """Where one rank runs: the Ray node's id, its IP address, the process's id there, and the
    device ids Ray gave it (of the backend's ``device_resource``; empty without one)."""

    node_id: str
    ip: str
    pid: int
    devices: tuple[str, ...] = ()


def _here(device: str | None) -> RayNode:
    import ray

    context = ray.get_runtime_context()
    ids = tuple(str(i) for i in context.get_accelerator_ids().get(device, ())) if device else ()
    return RayNode(context.get_node_id(), ray.util.get_node_ip_address(), os.getpid(), ids)


class RayDeviceHolder:
    """Holds rank 0's device in the placement group (rank 0 is the driver, not an actor: Ray would
    otherwise hand its device to a worker on the same node) and says which one it is."""

    def node(self, device: str) -> RayNode:
        """Where the reservation landed and the device ids Ray gave it."""
        return _here(device)


class RayWorker:
    """One worker rank inside a Ray actor (wrapped by ``ray.remote`` when the executor starts)."""

    def node(self, device: str | None = None) -> RayNode:
        """The Ray node this actor was placed on (and the ids of the ``device`` Ray gave it), once
        the worker's modules are imported (so the rendezvous that follows waits on no import)."""
        import plinth.runtime.worker  # noqa: F401 - the import ``worker_loop`` would make, done ahead

        return _here(device)

    def run(
        self, config: EngineConfig, rank: int, world_size: int, init_method: str, local_rank: int | None = None
    ) -> None:
        """The worker loop, until rank 0 broadcasts the end; an error reaches rank 0 through Ray.
        ``local_rank``: 0 where Ray gave this actor one device (it sees that one only)."""
        import ray

        interface = collectives_interface(ray.util.get_node_ip_address())
        if interface is not None:
            os.environ[HOST_COLLECTIVES_INTERFACE_ENV] = interface  # this actor's process only
        try:
            worker_loop(config, rank, world_size, init_method, local_rank)
        finally:
            close_world()


def collectives_interface(node_ip: str) -> str | None:
    """The network interface the host collectives must bind for other machines to reach this one,
    where they would not find it themselves: None unless ``$GLOO_SOCKET_IFNAME`` is unset, the Ray
    node's IP is not a loopback one, and the host's name resolves to a loopback address (as in many
    ``/etc/hosts``: the collectives would then advertise 127.0.0.1 to the other nodes, which cannot
    connect to it). Then the name of the interface that holds ``node_ip`` (Linux), else None with a
    warning naming the variable to set.
    """
    if os.environ.get(HOST_COLLECTIVES_INTERFACE_ENV) or ipaddress.ip_address(node_ip).is_loopback:
        return None
    try:
        resolved = socket.gethostbyname(socket.gethostname())
    except OSError:
        resolved = "127.0.0.1"  # unresolvable: the collectives fall back to the loopback too
    if not ipaddress.ip_address(resolved).is_loopback:
        return None
    interface = _interface_holding(node_ip)
    if interface is None:
        logger.warning(
            "this host's name resolves to %s but its Ray node IP is %s: set %s to the interface holding %s, "
            "or the other nodes cannot connect to this rank",
            *(resolved, node_ip, HOST_COLLECTIVES_INTERFACE_ENV, node_ip),
        )
    return interface


def _interface_holding(ip: str) -> str | None:
    """The name of the network interface whose IPv4 address is ``ip`` (Linux: SIOCGIFADDR), or None."""
    try:
        import fcntl
        import struct

        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address on this one
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


def placement_strategy() -> str:
    """``$PLINTH_RAY_PLACEMENT`` (default SPREAD), checked.

    :raises ValueError: it names no strategy Ray has.
    """
    value = os.environ.get(PLACEMENT_ENV, "SPREAD").strip().upper()
    if value not in STRATEGIES:
        raise ValueError(f"{PLACEMENT_ENV}={os.environ[PLACEMENT_ENV]!r} is not one of {', '.join(STRATEGIES)}")
    return value


def extra_resources() -> dict[str, float]:
    """``$PLINTH_RAY_RESOURCES``: the custom resources each worker bundle asks for (default none).

    :raises ValueError: it is not a JSON object of positive numbers.
    """
    raw = os.environ.get(RESOURCES_ENV, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{RESOURCES_ENV}={raw!r} is not JSON ({e}); e.g. '{{\"plinth_worker\": 1}}'") from e
    if not isinstance(value, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in value.values()
    ):
        raise ValueError(
            f"{RESOURCES_ENV}={raw!r} must be a JSON object of positive numbers, e.g. '{{\"gpu_box\": 1}}'"
        )
    if HOST_CORES in value:
        raise ValueError(f"{RESOURCES_ENV} must not set {HOST_CORES!r}: each bundle's cores come from num_threads")
    return {str(k): float(v) for k, v in value.items()}


def device_resource(config: EngineConfig) -> str | None:
    """The Ray resource each rank reserves for its device: ``$PLINTH_RAY_DEVICE`` where set (empty:
    none), else the backend's ``Capabilities.device_resource`` (``"GPU"`` for the GPU backends on
    hardware; None for the CPU backends: host cores only)."""
    raw = os.environ.get(DEVICE_ENV)
    if raw is not None:
        return raw.strip() or None
    from plinth.platform.host import default_host

    return default_host().select(config.backend).backend.capabilities().device_resource


def _device_options(device: str | None, extra: dict[str, float] | None = None) -> dict[str, Any]:
    """An actor's options for one ``device`` beside its ``extra`` resources (Ray spells GPUs
    ``num_gpus``, other devices as resources)."""
    if device is None:
        return {}
    return {"num_gpus": 1} if device == "GPU" else {"resources": {**(extra or {}), device: 1.0}}


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RayClusterError(
            f"distributed_executor='ray' needs Ray, which is not installed: pip install ray ({e})"
        ) from e
    return ray


def _check_reachable(address: str) -> None:
    """Fail fast, naming the fix, when ``address`` (``host:port``) has nothing listening."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", a ray:// URL without a port, ...: Ray's own error names it
    host = host.removeprefix("ray://").strip("[]")
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except OSError as e:
        raise RayClusterError(f"no Ray cluster is running at RAY_ADDRESS={address} ({e}): {_HOW_TO_START}") from e


def connect(ray: Any) -> bool:
    """Join the running cluster (``$RAY_ADDRESS``, else "auto"); never start one. Returns whether this
    call connected (False: the process was already connected, and stays so after ``close()``).

    :raises RayClusterError: no cluster is running there.
    """
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS", "").strip() or "auto"
    if address != "auto":
        _check_reachable(address)
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RayClusterError(f"cannot join a Ray cluster at address={address!r} ({e}): {_HOW_TO_START}") from e
    return True


class RayExecutor(Executor):
    """Ranks 1..N-1 as Ray actors in one placement group; rank 0 is the caller (the Ray driver).

    :param config: the engine's config (each actor builds its shard from it: the model path must
        name the same files on every node).
    :param world_size: the tensor-parallel size N.
    :raises RayClusterError: Ray is missing, no cluster runs, or it cannot place the N-1 ranks.
    :raises WorkerFailure: a rank failed to start or to join the world (named, with its error).
    """

    def __init__(self, config: EngineConfig, world_size: int) -> None:
        if world_size < 2:
            raise ValueError(f"RayExecutor needs world_size >= 2 (rank 0 is this process), got {world_size}")
        strategy, extra, device = placement_strategy(), extra_resources(), device_resource(config)
        self.ray = ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = world_size
        self.timeout_s = config.distributed_timeout_s
        self.closed = False
        self.actors: list[Any] = []
        self.nodes: list[RayNode] = []  # rank r's node is nodes[r - 1]
        self.placement: Any = None
        self.device = device  # the Ray resource of one rank's device; None: host cores only
        self.holder: Any = None  # rank 0's device reservation (with a device)
        self._runs: list[Any] = []
        cores = float(config.num_threads or 1)
        self.bundle: dict[str, float] = {HOST_CORES: cores, **extra, **({device: 1.0} if device else {})}
        self._owns_connection = connect(ray)
        try:
            self.driver_node = RayNode(
                ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()
            )
            bundles = [dict(self.bundle) for _ in range(world_size - 1)]
            first = 0
            if device:  # bundle 0: rank 0's device, on the driver's node (Ray's node:<ip> resource)
                bundles.insert(0, {device: 1.0, f"node:{self.driver_node.ip}": 0.001})
                first = 1
            self.placement = placement_group(bundles, strategy=strategy)
            self._wait_placed(strategy)
            if device:
                self.local_rank = self._hold_driver_device(device)
            actor_cls = ray.remote(RayWorker)
            for index in range(first, first + world_size - 1):
                placed = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=index)
                options = dict(num_cpus=cores, resources=extra or None, scheduling_strategy=placed)
                options.update(_device_options(device, extra))
                self.actors.append(actor_cls.options(**options).remote())
            self.nodes = self._where()
            self.init_method = f"tcp://{self.driver_node.ip}:{free_port(self.driver_node.ip)}"
            worker_local = 0 if device else None  # Ray shows an actor its one device only: index 0
            self._runs = [
                actor.run.remote(config, rank, world_size, self.init_method, worker_local)
                for rank, actor in enumerate(self.actors, start=1)
            ]
            with _bound_collectives(collectives_interface(self.driver_node.ip)):
                why = join_world_as_rank0(self.init_method, world_size, self.timeout_s, lambda: not self.alive())
            if why is not None:
                raise WorkerFailure(self.diagnose(why))
        except BaseException:
            self._teardown()
            raise
        logger.info(
            "tensor parallel over Ray: rank 0 on %s, ranks 1..%d on %s (%s)",
            self.driver_node.ip, world_size - 1, ", ".join(f"{n.ip}/{n.node_id[:8]}" for n in self.nodes), strategy,
        )  # fmt: skip

    def _wait_placed(self, strategy: str) -> None:
        """Wait (``distributed_timeout_s``) for the cluster to reserve every bundle, else name the lack."""
        if self.placement.wait(timeout_seconds=self.timeout_s):
            return
        ray, n = self.ray, self.world_size - 1
        wanted = {k: v * n for k, v in self.bundle.items()}
        total = ray.cluster_resources()
        missing = {k: f"{v:g} wanted, {total.get(k, 0):g} in the cluster" for k, v in wanted.items()}
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        raise RayClusterError(
            f"the Ray cluster did not place {n} worker rank(s) of {self.bundle} each ({strategy}) within "
            f"{self.timeout_s:g}s: {'; '.join(f'{k}: {v}' for k, v in missing.items())}; {nodes} alive node(s)"
            f"{' (STRICT_SPREAD needs one per rank)' if strategy == 'STRICT_SPREAD' else ''}. Add nodes with "
            f"`ray start --address=<head IP>:6379 --num-cpus=...`, lower num_threads, or set {PLACEMENT_ENV}=PACK"
        )

    def _hold_driver_device(self, device: str) -> int:
        """Reserve rank 0's device with a holder actor in bundle 0 and return its index on this node.

        :raises RayClusterError: Ray gave no device id (the resource is not an accelerator Ray manages).
        """
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        placed = PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=0)
        options: dict[str, Any] = dict(num_cpus=0, scheduling_strategy=placed, **_device_options(device))
        self.holder = ray.remote(RayDeviceHolder).options(**options).remote()
        held = ray.get(self.holder.node.remote(device), timeout=max(self.timeout_s, ACTOR_START_S))
        if held.node_id != self.driver_node.node_id or len(held.devices) != 1 or not held.devices[0].isdigit():
            raise RayClusterError(
                f"rank 0's {device} reservation came back as {held.devices or 'no device id'} on node "
                f"{held.ip}: {DEVICE_ENV} must name a device Ray manages (GPU, TPU, HPU, ...), one per rank"
            )
        self.driver_node = dataclasses.replace(self.driver_node, devices=held.devices)
        return int(held.devices[0])

    def _where(self) -> list[RayNode]:
        """Each actor's node, once every actor is up; an actor that could not start fails, by rank."""
        ray, nodes = self.ray, []
        for rank, actor in enumerate(self.actors, start=1):
            try:
                where = actor.node.remote(self.device) if self.device else actor.node.remote()
                nodes.append(ray.get(where, timeout=max(self.timeout_s, ACTOR_START_S)))
            except Exception as e:  # noqa: BLE001 - Ray's errors are many: each names the cause
                raise WorkerFailure(
                    f"rank {rank}'s Ray actor did not start: {_root_error(e)} (every node needs plinth, and the "
                    "model at the same path, in the Python environment its `ray start` runs)"
                ) from e
        return nodes

    def diagnose(self, what: str) -> str:
        """``what``, with every rank whose actor is gone and why (its error, or Ray's death cause)."""
        ray, parts = self.ray, [what]
        if self._runs:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=DIAGNOSE_WAIT_S)  # let Ray catch up
        for rank, run in enumerate(self._runs, start=1):
            ready, _ = ray.wait([run], timeout=0)
            if not ready:
                continue
            node = self.nodes[rank - 1]
            where = f"rank {rank} (Ray actor on {node.ip}, pid {node.pid})"
            try:
                ray.get(run, timeout=1)
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(e.cause, BaseException) else e
                parts.append(f"{where}: {type(cause).__name__}: {_first_line(cause)}")
            except ray.exceptions.RayActorError as e:
                parts.append(f"{where}: the actor died: {_death_cause(e)}")
            except Exception as e:  # noqa: BLE001 - any other Ray error still names the rank
                parts.append(f"{where}: {_root_error(e)}")
            else:
                parts.append(f"{where}: left its loop")
        return "; ".join(parts)

    def alive(self) -> bool:
        """Whether every actor is still in its loop."""
        if not self._runs:
            return bool(self.actors)
        ready, _ = self.ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        return not ready

    def kill(self) -> None:
        """Kill every actor at once (no goodbye over the world), and rank 0's device holder."""
        for actor in [*self.actors, *([self.holder] if self.holder is not None else [])]:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)

    def _teardown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        self.kill()
        if self.placement is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement)
        close_world()
        if self._owns_connection:
            with contextlib.suppress(Exception):
                self.ray.shutdown()

    def close(self) -> None:
        """Tell the workers to stop, wait for them, kill the actors, free the placement group, and
        disconnect if the executor connected. Bounded: the goodbye broadcast by ``distributed_timeout_s``
        (a hung rank), the wait for the actors to leave their loop by ``CLOSE_WAIT_S``."""
        if self.closed:
            return
        self.closed = True
        t0 = time.monotonic()
        if self.alive():
            try:
                broadcast_object(None)
            except CollectiveError:
                pass  # a rank is gone or hung: no use waiting for it to say goodbye
            else:
                with contextlib.suppress(Exception):
                    self.ray.wait(self._runs, num_returns=len(self._runs), timeout=CLOSE_WAIT_S)
        self._teardown()
        logger.debug("Ray executor closed in %.1fs", time.monotonic() - t0)


@contextlib.contextmanager
def _bound_collectives(interface: str | None) -> Iterator[None]:
    """``$GLOO_SOCKET_IFNAME`` set to ``interface`` (None: left alone) while rank 0 joins the world,
    then restored: the engine's process keeps no setting it did not ask for."""
    if interface is None:
        yield
        return
    before = os.environ.get(HOST_COLLECTIVES_INTERFACE_ENV)
    os.environ[HOST_COLLECTIVES_INTERFACE_ENV] = interface
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HOST_COLLECTIVES_INTERFACE_ENV, None)
        else:
            os.environ[HOST_COLLECTIVES_INTERFACE_ENV] = before


def _first_line(e: BaseException) -> str:
    """An error's message, its first non-empty line (Ray's carry whole remote tracebacks)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt):")


def _root_error(e: BaseException) -> str:
    """The innermost ``SomeError: message`` line of a Ray error (its text carries the remote
    traceback, the root cause last), else its first line."""
    lines = [_ANSI.sub("", line).strip() for line in str(e).splitlines()]
    raised = [line for line in lines if _RAISED.match(line)]
    return raised[-1] if raised else _first_line(e)


def _death_cause(e: BaseException) -> str:
    """Ray's account of an actor's death, without its indented details (class, pid, namespace, ...):
    e.g. "The actor died unexpectedly before finishing this task. The actor is dead because it was
    killed by `ray.kill`."."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip() and not line[:1].isspace()]
    return " ".join(lines) if lines else type(e).__name__
