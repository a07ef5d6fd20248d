"""The collectives tier: a backend's :class:`~plinth.platform.backend.Communicator` on 2 ranks.

Each case is one collective in one declared dtype and one input layout (contiguous, a transposed
view, a strided slice). The suite starts the two ranks as processes (``python -m
plinth_conformance.collectives``); each selects the backend by name, joins a ``torch.distributed``
world on the loopback, asks the backend's device services for its communicator and runs every case
in one fixed order (a collective is called by every rank). Inputs are seeded per (case, rank), so
each rank computes every rank's inputs and the expected result itself: sums in float64, rounded
once to the dtype (2 ranks: one rounding, so the check is to the dtype's unit roundoff), gathers
and broadcasts bit for bit, and the input of an in-place collective must come back in the same
tensor, its other elements (outside a strided view) untouched.

The *grouped* cases (plugin API 1.10, tensor and pipeline parallelism together) ask the communicator
again with the world split as ``groups=[[1, 0]]``: one group listing the ranks in reverse, so world
rank 1 must be the group's rank 0. Every op then runs by group rank (a gather in group order, a
broadcast from group rank 1, a send to group rank 0): a communicator that numbers a group's ranks by
world rank fails them. A backend whose communicator takes no ``groups`` skips them, saying so.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from plinth_conformance.cases import case_seed

#: The collectives checked, and the input layouts.
OPS: tuple[str, ...] = ("all_reduce", "all_gather", "broadcast", "send_recv", "barrier")
LAYOUTS: tuple[str, ...] = ("contiguous", "transposed", "strided")
WORLD = 2
_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass(frozen=True, slots=True)
class CollectiveCase:
    """One collective in one dtype and input layout, on 2 ranks (``grouped``: over the reversed group)."""

    op: str
    dtype: str
    layout: str
    tier: str = "collectives"
    grouped: bool = False

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``coll-all_reduce-f32-strided``, ``coll-grouped-send_recv-f32-contiguous``."""
        kind = "coll-grouped" if self.grouped else "coll"
        return f"{kind}-{self.op}-{_SHORT[self.dtype]}-{self.layout}"


#: A skipped case's result starts with this (the rest says why).
SKIPPED = "skipped: "

#: The grouped cases' split of the world: one group, its ranks listed in reverse.
REVERSED_GROUPS = [[1, 0]]


def collective_cases(dtypes: frozenset[str]) -> list[CollectiveCase]:
    """Every op in every declared dtype and layout (a barrier takes no tensor: one case), then each
    op once more over the reversed group (float32, contiguous: the numbering is what they check)."""
    out = [CollectiveCase("barrier", "float32", "contiguous")]
    for dtype in sorted(d for d in dtypes if d in _DTYPES):
        for op in OPS:
            if op != "barrier":
                out += [CollectiveCase(op, dtype, layout) for layout in LAYOUTS]
    return out + [CollectiveCase(op, "float32", "contiguous", grouped=True) for op in OPS]


def _grouped_communicator(services: Any, rank: int, backend: str | None) -> tuple[Any, str | None]:
    """``(communicator over REVERSED_GROUPS, None)``, or ``(None, why not)``: skipped where the
    backend's communicator takes no ``groups``, an error where it numbers the group wrongly."""
    if "groups" not in inspect.signature(services.communicator).parameters:
        return None, SKIPPED + "the backend's DeviceServices.communicator takes no groups (plugin API 1.10)"
    comm = services.communicator(WORLD, rank, backend, groups=REVERSED_GROUPS)
    if (comm.rank, comm.world_size) != (REVERSED_GROUPS[0].index(rank), WORLD):
        return None, (
            f"groups={REVERSED_GROUPS}: world rank {rank} got group rank {comm.rank} of {comm.world_size}, "
            f"not {REVERSED_GROUPS[0].index(rank)} of {WORLD} (a group's ranks are numbered by place in its list)"
        )
    return comm, None


def _input(case: CollectiveCase, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(base, view)``: rank ``rank``'s input as the case's layout (a view into ``base``)."""
    gen = torch.Generator().manual_seed(case_seed(case.id) + rank)
    base = torch.randn(12, 10, generator=gen).to(_DTYPES[case.dtype])
    if case.layout == "transposed":
        return base, base.t()  # [10, 12], strides (1, 10)
    if case.layout == "strided":
        return base, base[1::2, ::3]  # [6, 4], every other row, every third column
    return base, base


def _check(case: CollectiveCase, comm: Any, rank: int) -> str | None:
    """None when the collective is right on this rank; else what was wrong."""
    dtype = _DTYPES[case.dtype]
    if case.op == "barrier":
        comm.barrier()
        return None
    base, view = _input(case, rank)
    outside = base.clone()
    mask = torch.zeros_like(base, dtype=torch.bool)  # the elements the view covers
    mask[1::2, ::3] = True
    views = [_input(case, r)[1] for r in range(WORLD)]
    if case.op == "all_reduce":
        want = torch.stack([v.double() for v in views]).sum(0).to(dtype)
        out = comm.all_reduce(view)
        if out.data_ptr() != view.data_ptr() or out.shape != view.shape:
            return "all_reduce did not return its input tensor (it must reduce in place)"
        got = view
        exact = torch.equal(got, want)
        if not exact and not torch.allclose(got.double(), want.double(), rtol=torch.finfo(dtype).eps, atol=0):
            err = (got.double() - want.double()).abs().max().item()
            return f"all_reduce: max error {err:.3g} (the sum of 2 values is one rounding away)"
    elif case.op == "all_gather":
        want = torch.cat(views, dim=-1)
        got = comm.all_gather(view, dim=-1)
        if tuple(got.shape) != tuple(want.shape) or not torch.equal(got, want):
            return f"all_gather: {tuple(got.shape)} not equal to the ranks' inputs concatenated {tuple(want.shape)}"
        got0 = comm.all_gather(view, dim=0)
        if not torch.equal(got0, torch.cat(views, dim=0)):
            return "all_gather along dim 0: not the ranks' inputs in rank order"
    elif case.op == "broadcast":
        want = views[1].clone()
        comm.broadcast(view, src=1)
        if not torch.equal(view, want):
            return "broadcast from rank 1: this rank's tensor does not hold rank 1's values"
    elif case.op == "send_recv":
        other = 1 - rank
        if rank == 0:
            comm.send(view, 1).wait()
            comm.recv(view, 1)
        else:
            saved = view.clone()
            comm.recv(view, 0)
            comm.send(saved, 0).wait()
        if not torch.equal(view, views[other]):
            return f"send/recv: rank {rank} did not receive rank {other}'s tensor bit for bit"
    if case.layout == "strided" and not torch.equal(base[~mask], outside[~mask]):
        return f"{case.op} wrote outside the strided view it was given"
    return None


def run_rank(backend: str, rank: int, init_method: str, out: Path, timeout_s: float) -> int:
    """One rank: every case in order; the results (case id -> error or None) to ``out``."""
    from plinth.parallel.comm import all_gather_object, close_world, init_world
    from plinth.platform.host import default_host

    results: dict[str, str | None] = {}
    try:
        status = default_host().select(backend)
        caps = status.backend.capabilities()
        cases = collective_cases(caps.dtypes)
        init_world(init_method, WORLD, rank, timeout_s)
        # both ranks on this host: local rank = rank, a device each (plugin API 1.13); a host with
        # one device cannot hold the tier: every case skipped, saying so, on both ranks
        try:
            status.backend.bind_local_rank(rank)
            unbound = None
        except ValueError as e:
            unbound = f"rank {rank} has no device of its own ({e}): the tier needs {WORLD} devices"
        why_not = next((w for w in all_gather_object(unbound) if w is not None), None)
        if why_not is not None:
            results.update({case.id: SKIPPED + why_not for case in cases})
            return 0
        services = status.backend.device_services()
        comm = services.communicator(WORLD, rank, caps.communicator)
        for case in cases:
            if case.grouped:
                break
            try:
                results[case.id] = _check(case, comm, rank)
            except Exception as e:  # noqa: BLE001 - a case's failure is its result
                results[case.id] = f"{type(e).__name__}: {e}"
        grouped, why = _grouped_communicator(services, rank, caps.communicator)
        for case in (c for c in cases if c.grouped):
            try:
                results[case.id] = why if grouped is None else _check(case, grouped, grouped.rank)
            except Exception as e:  # noqa: BLE001 - a case's failure is its result
                results[case.id] = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - the whole rank failed: say so for every case
        results["*"] = f"rank {rank} failed to start: {type(e).__name__}: {e}"
    finally:
        out.write_text(json.dumps(results))
        close_world()
    return 0


def run_collectives(backend: str, timeout_s: float = 120.0) -> dict[str, str | None]:
    """Start the 2 ranks, wait (bounded), and merge: a case passes when both ranks say None."""
    from plinth.parallel.executor import free_port

    init_method = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="plinth-collectives-") as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(WORLD)]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "plinth_conformance.collectives",
                    "--backend",
                    backend,
                    "--rank",
                    str(r),
                    "--init-method",
                    init_method,
                    "--out",
                    str(outs[r]),
                    "--timeout",
                    str(timeout_s / 2),
                ],
                env=dict(os.environ),
            )  # fmt: skip
            for r in range(WORLD)
        ]
        merged: dict[str, str | None] = {}
        for r, proc in enumerate(procs):
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                return {"*": f"rank {r} did not finish within {timeout_s:g} s"}
            if not outs[r].exists():
                return {"*": f"rank {r} exited with {proc.returncode} without results"}
            for case_id, error in json.loads(outs[r].read_text()).items():
                if error is not None and error.startswith(SKIPPED):
                    merged.setdefault(case_id, error)  # a failure on another rank wins over a skip
                elif error is not None:
                    merged[case_id] = f"rank {r}: {error}"
                else:
                    merged.setdefault(case_id, None)
        return merged


def main(argv: list[str] | None = None) -> int:
    """``python -m plinth_conformance.collectives``: one rank of the collectives tier."""
    p = argparse.ArgumentParser(prog="python -m plinth_conformance.collectives", description=main.__doc__)
    p.add_argument("--backend", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    return run_rank(args.backend, args.rank, args.init_method, args.out, args.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
