"""The collectives tier's checker against simulated communicators: the right one passes every case,
each broken one fails the cases it breaks (no processes: a fake rank knows the other's inputs, which
are seeded)."""

from __future__ import annotations

import pytest
import torch

from plinth.platform.backend import Communicator
from plinth_conformance.collectives import (
    SKIPPED,
    WORLD,
    CollectiveCase,
    _check,
    _grouped_communicator,
    _input,
    collective_cases,
)


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
    assert len(results) == 1 + 3 * 4 * 3 + 5  # barrier, 4 ops x 3 dtypes x 3 layouts, 5 grouped
    assert all(v is None for v in results.values()), {k: v for k, v in results.items() if v}


@pytest.mark.parametrize(
    "broken,failing,message",
    [
        (NotInPlace, "-all_reduce-", "did not return its input tensor"),
        (GatherReversed, "-all_gather-", "not equal to the ranks' inputs concatenated"),
        (ReducesTheWholeBase, "-all_reduce-", "outside the strided view"),
        (SumInLowPrecisionTwice, "-all_reduce-", "max error"),
    ],
)
def test_each_broken_communicator_fails_only_its_collective(broken: type[FakeComm], failing: str, message: str) -> None:
    results = _run(broken(0), DTYPES)
    bad = {k: v for k, v in results.items() if v is not None}
    assert bad and all(failing in k for k in bad), bad
    assert any(message in v for v in bad.values()), bad


class _Services:
    """Device services whose communicator numbers a group's ranks by place (right) or by world rank."""

    def __init__(self, by_place: bool) -> None:
        self.by_place = by_place

    def communicator(
        self, world_size: int, rank: int, backend: str | None, *, groups: list[list[int]] | None = None
    ) -> FakeComm:
        assert groups is not None
        return FakeComm(groups[0].index(rank) if self.by_place else rank)


class _OldServices:
    """A communicator written for API 1.7-1.9: no groups."""

    def communicator(self, world_size: int, rank: int, backend: str | None) -> FakeComm:
        return FakeComm(rank)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_grouped_cases_need_ranks_numbered_by_place_in_the_group(rank: int) -> None:
    comm, why = _grouped_communicator(_Services(by_place=True), rank, None)
    assert why is None and comm is not None and comm.rank == 1 - rank  # world rank 1 is group rank 0
    comm, why = _grouped_communicator(_Services(by_place=False), rank, None)
    assert comm is None and why is not None and "numbered by place in its list" in why
    comm, why = _grouped_communicator(_OldServices(), rank, None)
    assert comm is None and why is not None and why.startswith(SKIPPED) and "plugin API 1.10" in why
