"""A shared-memory all-reduce for ranks on one host: what a tensor-parallel decode step mostly waits on.

gloo's all-reduce goes through TCP on the loopback: ~0.6 ms a call here, 62 calls a decode step of a
30-layer model at TP=2. Ranks on one host can instead meet in one shared-memory segment: each copies
its tensor into its own slot, raises its flag, waits for every flag, then sums the slots in rank order
into its tensor (so every rank gets the same bits, as gloo's result). Two slot sets alternate by call,
so a rank may start the next call while a slower one still reads this call's slots: a rank raises its
flag for call ``n + 1`` only after reading call ``n``, and writes call ``n + 2``'s slot (the same set
as ``n``) only after seeing every flag of ``n + 1``.

Everything else (gathers, broadcasts, send/recv, the barrier, and all-reduces too large for a slot or
of another dtype) goes to the wrapped gloo communicator. Used only where every rank of the group runs
on this host (the ranks compare the kernel's boot id and /dev/shm is there) on x86-64, whose stores are
seen by other cores in program order, so a flag raised after a copy is never seen before the copy;
elsewhere, or with ``PLINTH_CPU_SHM_ALLREDUCE=0``, the group keeps gloo.

A dead peer fails the wait at once (its pid is checked while waiting), a hung one at the timeout;
either raises :class:`~plinth.parallel.comm.CollectiveError`, as a failed gloo collective does.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from plinth.parallel.comm import CollectiveError
from plinth.platform.backend import Communicator, PendingSend

#: Bytes of one rank's slot: a decode step's [64, 8192] fp32 activations fit; bigger all-reduces
#: (prefill chunks) go to gloo, where a copy of megabytes costs as much as the socket.
SLOT_BYTES = 2 * 1024 * 1024
_FLAG_STRIDE = 8  # int64s: one flag per 64-byte cache line, so no two ranks write the same line
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SHM_DIR = Path("/dev/shm")


def _host_id() -> int:
    """This boot of this machine, as a 62-bit number (equal on every rank of the host)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return 0
    return int.from_bytes(hashlib.sha256(boot.encode()).digest()[:8], "little") >> 2


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: not gone and not a zombie (a dead worker stays one until
    its parent, often the very rank waiting for it, reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :][:1] not in ("Z", "X")


def shm_allowed() -> bool:
    """Whether this rank can take part: x86-64 Linux with /dev/shm, not switched off by the env."""
    if os.environ.get("PLINTH_CPU_SHM_ALLREDUCE", "1") == "0":
        return False
    return platform.machine() in ("x86_64", "AMD64") and _SHM_DIR.is_dir() and _host_id() != 0


class SharedMemoryCommunicator(Communicator):
    """All-reduce through a shared segment, everything else through ``inner`` (see the module docstring).

    Build it with :meth:`create` on every rank of ``inner``'s group (a collective).
    """

    def __init__(self, inner: Communicator, segment: mmap.mmap, pids: list[int], timeout_s: float) -> None:
        self.inner = inner
        self.rank, self.world_size = inner.rank, inner.world_size
        self._segment = segment
        self._pids = pids
        self._timeout_s = timeout_s
        n = self.world_size
        raw = torch.frombuffer(segment, dtype=torch.uint8)
        # the flags (rank r's at word r * stride) as Python ints: a read costs ~50 ns against ~5 us
        # for a torch op, and the wait loop reads them thousands of times
        self._flag_words = memoryview(segment).cast("q")
        self._slots = raw[n * _FLAG_STRIDE * 8 :].view(2, n, SLOT_BYTES)  # [set, rank, bytes]
        self._calls = 0

    @classmethod
    def create(cls, inner: Communicator, timeout_s: float = 60.0) -> Communicator:
        """``inner`` wrapped, when every rank of its group is on this host and can map the segment;
        else ``inner`` itself. Every rank of the group calls it; all reach the same answer."""
        n, rank = inner.world_size, inner.rank
        mine = torch.tensor([[_host_id() if shm_allowed() else -1 - rank, os.getpid()]], dtype=torch.int64)
        hosts = inner.all_gather(mine, dim=0)  # [n, 2]: host id (or a unique refusal), pid
        if n < 2 or len({int(h) for h in hosts[:, 0]}) != 1 or int(hosts[0, 0]) < 0:
            return inner
        size = n * _FLAG_STRIDE * 8 + 2 * n * SLOT_BYTES
        name = torch.zeros(64, dtype=torch.uint8)
        if rank == 0:
            fd, path = tempfile.mkstemp(prefix="plinth-allreduce-", dir=_SHM_DIR)
            os.ftruncate(fd, size)  # zero-filled: every flag starts at call 0
            os.close(fd)
            encoded = path.encode()
            name[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
        inner.broadcast(name, src=0)
        path = bytes(name[name.nonzero().flatten()].tolist()).decode()
        with open(path, "r+b") as f:
            segment = mmap.mmap(f.fileno(), size)
        inner.barrier()  # every rank has it mapped: the name can go (no file outlives the ranks)
        if rank == 0:
            os.unlink(path)
        return cls(inner, segment, [int(p) for p in hosts[:, 1]], timeout_s)

    def _wait_for(self, call: int) -> None:
        """Return once every rank's flag reached ``call``; a dead peer or the timeout raises."""
        words, offsets = self._flag_words, range(0, self.world_size * _FLAG_STRIDE, _FLAG_STRIDE)
        spins, start = 0, 0.0
        while any(words[o] < call for o in offsets):
            spins += 1
            if spins < 200:
                continue  # ranks on free cores arrive within microseconds of each other: spin first
            if start == 0.0:
                start = time.monotonic()
            # then give the core away: ranks may share cores, and the one awaited may need this one
            if spins < 5000:
                os.sched_yield()
            else:
                time.sleep(0.0002)
            if spins % 500 == 0:
                self._check_peers(call, time.monotonic() - start)

    def _check_peers(self, call: int, waited: float) -> None:
        for r, pid in enumerate(self._pids):
            if r == self.rank or self._flag_words[r * _FLAG_STRIDE] >= call:
                continue
            if not _alive(pid):
                raise CollectiveError(
                    f"all_reduce on rank {self.rank} of {self.world_size} failed: rank {r} (pid {pid}) is gone"
                )
        if waited > self._timeout_s:
            raise CollectiveError(
                f"all_reduce on rank {self.rank} of {self.world_size} failed: timed out after {waited:.1f} s "
                "waiting in shared memory"
            )

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.dtype not in _DTYPES or nbytes > SLOT_BYTES or tensor.device.type != "cpu":
            return self.inner.all_reduce(tensor)
        self._calls += 1
        call = self._calls
        slots = self._slots[call % 2, :, :nbytes].view(tensor.dtype)  # [n, numel]
        slots[self.rank].view(tensor.shape).copy_(tensor)
        self._flag_words[self.rank * _FLAG_STRIDE] = call  # after the copy: x86 shows stores in order
        self._wait_for(call)
        # the same sum on every rank: slot 0 first, then the others in rank order
        tensor.copy_(slots[0].view(tensor.shape))
        for r in range(1, self.world_size):
            tensor.add_(slots[r].view(tensor.shape))
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self.inner.all_gather(tensor, dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self.inner.broadcast(tensor, src)

    def barrier(self) -> None:
        self.inner.barrier()

    def send(self, tensor: torch.Tensor, dst: int) -> PendingSend:
        return self.inner.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.inner.recv(tensor, src)
