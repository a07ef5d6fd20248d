"""The collectives tier's checker against simulated communicators: the right one passes every case,
each broken one fails the cases it breaks (no processes: a fake rank knows the other's inputs, which
are seeded)."""

from __future__ import annotations

import pytest
import torch

from plinth.platform.backend import Communicator
from plinth_conformance.collectives import WORLD, CollectiveCase, _check, _input, collective_cases


class _Sent:
    def wait(self) -> None:
        pass


class FakeComm(Communicator):
    """Rank ``rank`` of 2, answering from the case's seeded inputs of both ranks."""

    def __init__(self, rank: int) -> None:
        self.rank, self.world_size = rank, WORLD
        self.case: CollectiveCase | None = None
        self.outbox: torch.Tensor | None = None

    def _views(self) -> list[torch.Tensor]:
        assert self.case is not None
        return [_input(self.case, r)[1] for r in range(WORLD)]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        total = sum(v.double() for v in self._views())
        return tensor.copy_(total)

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._views(), dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor.copy_(self._views()[src])

    def barrier(self) -> None:
        pass

    def send(self, tensor: torch.Tensor, dst: int) -> _Sent:
        return _Sent()

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return tensor.copy_(self._views()[src])


class NotInPlace(FakeComm):
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.contiguous() + self._views()[1 - self.rank]  # a new tensor; the input untouched


class GatherReversed(FakeComm):
    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._views()[::-1], dim=dim)


class ReducesTheWholeBase(FakeComm):
    """Writes storage next to a strided view (as a kernel that reduces the dense span would)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        super().all_reduce(tensor)
        if tensor.storage_offset() > 0:  # the element just before the view's first: not the view's
            torch.as_strided(tensor, (1,), (1,), tensor.storage_offset() - 1).add_(1.0)
        return tensor


class SumInLowPrecisionTwice(FakeComm):
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        a, b = self._views()
        return tensor.copy_((a + b) * 1.001)


def _run(comm: FakeComm, dtypes: frozenset[str]) -> dict[str, str | None]:
    out = {}
    for case in collective_cases(dtypes):
        comm.case = case
        out[case.id] = _check(case, comm, comm.rank)
    return out


DTYPES = frozenset({"float32", "bfloat16", "float16"})


@pytest.mark.parametrize("rank", [0, 1])
def test_a_correct_communicator_passes_every_case(rank: int) -> None:
    results = _run(FakeComm(rank), DTYPES)
    assert len(results) == 1 + 3 * 4 * 3
    assert all(v is None for v in results.values()), {k: v for k, v in results.items() if v}


@pytest.mark.parametrize(
    "broken,failing,message",
    [
        (NotInPlace, "coll-all_reduce-", "did not return its input tensor"),
        (GatherReversed, "coll-all_gather-", "not equal to the ranks' inputs concatenated"),
        (ReducesTheWholeBase, "coll-all_reduce-", "outside the strided view"),
        (SumInLowPrecisionTwice, "coll-all_reduce-", "max error"),
    ],
)
def test_each_broken_communicator_fails_only_its_collective(broken: type[FakeComm], failing: str, message: str) -> None:
    results = _run(broken(0), DTYPES)
    bad = {k: v for k, v in results.items() if v is not None}
    assert bad and all(k.startswith(failing) for k in bad), bad
    assert any(message in v for v in bad.values()), bad
