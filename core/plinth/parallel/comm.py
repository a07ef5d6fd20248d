"""``torch.distributed`` collectives: the default communicator, and the CPU control group.

Rank 0 (the engine: scheduler and sampler) and the workers join one ``torch.distributed`` world over
TCP. The world's default group is gloo on the CPU: rank 0 broadcasts each step's scheduler output
(plain value objects) over it. The device group, which the model's collectives run on, is the one
the backend's :meth:`~plinth.platform.backend.DeviceServices.communicator` makes (the default: a new
group of the backend's declared communicator, gloo on the CPU).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from plinth.platform.backend import Communicator, PendingSend
from plinth.platform.devices import HOST_COLLECTIVES

#: The world's collective timeout, kept for the groups made later: torch gives a new group its own
#: default (30 minutes for gloo), not the world's, so a rank hung inside a forward's all-reduce would
#: hold rank 0 that long instead of ``--distributed-timeout``.
_timeout: datetime.timedelta | None = None


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a rank died or hangs. The message names the operation."""


#: How long the ranks get to meet at all: a worker first starts an interpreter and imports torch,
#: which took over 5 s on a loaded 2-core host (a short --distributed-timeout failed the start). A
#: worker that dies meanwhile is noticed at once anyway (rank 0 watches the processes).
START_TIMEOUT_S = 60.0


def init_world(init_method: str, world_size: int, rank: int, timeout_s: float) -> None:
    """Join the ``torch.distributed`` world (gloo, CPU), waiting up to ``max(timeout_s,``
    :data:`START_TIMEOUT_S```)`` for the other ranks; every collective after this times out after
    ``timeout_s`` seconds instead of waiting for a dead rank forever (the groups made after it too)."""
    global _timeout
    _timeout = datetime.timedelta(seconds=timeout_s)
    # torch before 2.9 (the ipex lane's 2.8) has no ProcessGroup.set_timeout: there the start waits
    # the collective timeout, as it did before
    settable = hasattr(dist.ProcessGroup, "set_timeout")
    dist.init_process_group(
        HOST_COLLECTIVES,
        init_method=init_method,
        world_size=world_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=max(timeout_s, START_TIMEOUT_S) if settable else timeout_s),
    )
    if settable:
        dist.group.WORLD.set_timeout(_timeout)  # type: ignore[union-attr]  # the collectives' own timeout


def world_timeout_s() -> float | None:
    """The world's collective timeout in seconds (None before :func:`init_world`), for a communicator
    of the backend's own that waits outside torch (a shared-memory all-reduce)."""
    return None if _timeout is None else _timeout.total_seconds()


def close_world() -> None:
    """Leave the world (a no-op when this process never joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``src``'s picklable ``obj`` on every rank, over the CPU control group.

    :raises CollectiveError: a rank is gone or the broadcast timed out.
    """
    box = [obj]
    try:
        dist.broadcast_object_list(box, src=src)
    except (RuntimeError, ValueError) as e:  # gloo: "Connection closed by peer", a timeout, ...
        raise CollectiveError(f"broadcast of the step from rank {src} failed: {e}") from e
    return box[0]


def gather_object(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's picklable ``obj``, in rank order, on ``dst`` (None elsewhere), over the CPU control
    group.

    :raises CollectiveError: a rank is gone or the gather timed out.
    """
    box: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == dst else None
    try:
        dist.gather_object(obj, box, dst=dst)
    except (RuntimeError, ValueError) as e:
        raise CollectiveError(f"gather to rank {dst} failed: {e}") from e
    return box


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank, over the CPU control group.

    :raises CollectiveError: a rank is gone or the gather timed out.
    """
    box: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(box, obj)
    except (RuntimeError, ValueError) as e:
        raise CollectiveError(f"all-gather of the ranks' start-up facts failed: {e}") from e
    return box


class _Pending:
    """A ``torch.distributed`` isend (holding its buffer alive until it is done)."""

    def __init__(self, work: Any, buf: torch.Tensor, rank: int) -> None:
        self.work, self.buf, self.rank = work, buf, rank

    def wait(self) -> None:
        try:
            self.work.wait()
        except (RuntimeError, ValueError) as e:
            raise CollectiveError(f"send on rank {self.rank} failed: {e}") from e


class TorchDistributedCommunicator(Communicator):
    """:class:`Communicator` over one ``torch.distributed`` process group.

    :param group: the process group (None: the default group).
    :param rank: this process's rank in it; ``world_size`` its size.
    :param members: the group's ranks in the world, in group-rank order (None: the whole world, where
        the two numberings agree). ``send``/``recv``/``broadcast`` take group ranks; torch wants world ranks.
    """

    def __init__(self, group: Any, rank: int, world_size: int, members: list[int] | None = None) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.members = members if members is not None else list(range(world_size))
        # torch numbers a group's ranks in sorted order whatever order they were listed in: our rank
        # i's part of a torch all_gather is at torch rank _torch_rank[i] (the conformance suite's
        # grouped cases list a group in reverse and caught gathers in torch's order)
        ordered = sorted(self.members)
        self._torch_rank = [ordered.index(m) for m in self.members]

    @classmethod
    def new_group(cls, world_size: int, rank: int, backend: str) -> TorchDistributedCommunicator:
        """A new group of ``backend`` over every rank of the (initialised) world."""
        return cls.split([list(range(world_size))], rank, backend)

    @classmethod
    def split(cls, groups: list[list[int]], rank: int, backend: str) -> TorchDistributedCommunicator:
        """The world split into ``groups`` (every rank passes the same list): a new group of ``backend``
        for each, and this communicator over the one that holds world rank ``rank``.

        torch makes every rank of the world create every group, in the same order, members or not.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: the core joins the world first")
        mine: TorchDistributedCommunicator | None = None
        for members in groups:
            group = dist.new_group(list(members), backend=backend, timeout=_timeout)
            if rank in members:
                mine = cls(group, list(members).index(rank), len(members), list(members))
        if mine is None:
            raise ValueError(f"rank {rank} is in none of the groups {groups}")
        return mine

    def _run(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, group=self.group, **kwargs)
        except (RuntimeError, ValueError) as e:
            raise CollectiveError(f"{what} on rank {self.rank} of {self.world_size} failed: {e}") from e

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_contiguous():
            self._run("all_reduce", dist.all_reduce, tensor)
            return tensor
        buf = tensor.contiguous()  # a collective needs dense memory: reduce a copy, write it back
        self._run("all_reduce", dist.all_reduce, buf)
        return tensor.copy_(buf)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        src = tensor.contiguous()
        parts = [torch.empty_like(src) for _ in range(self.world_size)]
        self._run("all_gather", dist.all_gather, parts, src)
        return torch.cat([parts[r] for r in self._torch_rank], dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._run("broadcast", dist.broadcast, buf, self.members[src])
        return tensor if buf is tensor else tensor.copy_(buf)

    def barrier(self) -> None:
        self._run("barrier", dist.barrier)

    def send(self, tensor: torch.Tensor, dst: int) -> PendingSend:
        buf = tensor.contiguous()
        try:
            work = dist.isend(buf, self.members[dst], group=self.group)
        except (RuntimeError, ValueError) as e:
            raise CollectiveError(f"send on rank {self.rank} of {self.world_size} failed: {e}") from e
        return _Pending(work, buf, self.rank)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        self._run("recv", dist.recv, buf, self.members[src])
        return tensor if buf is tensor else tensor.copy_(buf)
