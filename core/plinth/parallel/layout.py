"""Where each rank sits when the model is split both ways: a grid of pipeline stages by tensor-parallel ranks.

``rank = stage * tensor_parallel_size + tp_rank``: a stage's tensor-parallel ranks are neighbours, so
where a host holds whole stages (the usual deployment: TP inside a machine, PP across machines) its
all-reduces stay on the host and only the hidden states of the stage boundary cross the network.
Rank 0 is stage 0's tensor-parallel rank 0: the engine (scheduler, sampler). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """One rank's place in the ``pipeline_parallel_size`` x ``tensor_parallel_size`` grid.

    :param tensor_parallel_size: ranks each stage's layers are split over.
    :param pipeline_parallel_size: stages the layers are split into.
    :param rank: this process's rank in the world (``0 .. world_size - 1``).
    """

    tensor_parallel_size: int
    pipeline_parallel_size: int
    rank: int

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(
                f"parallel sizes must be >= 1, got tensor {self.tensor_parallel_size}, "
                f"pipeline {self.pipeline_parallel_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")

    @property
    def world_size(self) -> int:
        """Every rank: tensor-parallel times pipeline-parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def tp_rank(self) -> int:
        """This rank's place in its stage's tensor-parallel group."""
        return self.rank % self.tensor_parallel_size

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.rank // self.tensor_parallel_size

    def tp_groups(self) -> list[list[int]]:
        """The world split into tensor-parallel groups: one per stage, its ranks in ``tp_rank`` order."""
        tp = self.tensor_parallel_size
        return [[s * tp + t for t in range(tp)] for s in range(self.pipeline_parallel_size)]

    def pp_groups(self) -> list[list[int]]:
        """The world split into pipeline groups: one per ``tp_rank``, its ranks in stage order (a
        stage's rank sends its hidden states to the next stage's rank of the same ``tp_rank``)."""
        tp = self.tensor_parallel_size
        return [[s * tp + t for s in range(self.pipeline_parallel_size)] for t in range(tp)]


def local_ranks(hosts: list[str]) -> list[int]:
    """Each rank's index among the ranks on its host, given every rank's host (in rank order): the
    local rank a backend maps to a device (``Backend.bind_local_rank``)."""
    seen: dict[str, int] = {}
    out = []
    for host in hosts:
        out.append(seen.get(host, 0))
        seen[host] = out[-1] + 1
    return out
