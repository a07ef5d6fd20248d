"""The default communicator on real gloo ranks (processes on the loopback): a group made after the
world keeps the world's timeout, and a split group is numbered by place in its list."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plinth.parallel.executor import free_port

_RANK = textwrap.dedent(
    """
    import json, os, sys, time, torch
    from plinth.parallel.comm import CollectiveError, TorchDistributedCommunicator, close_world, init_world
    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    init_world(init, 2, rank, 2.0)
    reversed_group = TorchDistributedCommunicator.split([[1, 0]], rank, "gloo")
    whole = TorchDistributedCommunicator.new_group(2, rank, "gloo")
    gathered = reversed_group.all_gather(torch.tensor([float(rank)]), dim=0).tolist()
    result = {"group_rank": reversed_group.rank, "gathered": gathered}
    if rank == 1:
        time.sleep(20)  # alive, answering nothing: rank 0's all-reduce must give up at the world's 2 s
    else:
        t0 = time.monotonic()
        try:
            whole.all_reduce(torch.ones(4))
            result["error"] = None
        except CollectiveError as e:
            result["error"] = str(e)[:200]
        result["seconds"] = time.monotonic() - t0
    with open(out, "w") as f:
        json.dump(result, f)
    # no interpreter teardown: gloo's destructors may abort ("terminate called without an active
    # exception", SIGABRT) in a process whose collective timed out; what is tested is written above
    os._exit(0)
    """
)


@pytest.mark.slow
def test_groups_keep_the_world_timeout_and_number_ranks_by_place(tmp_path: Path) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), init, str(outs[r])]) for r in range(2)]
    try:
        assert procs[0].wait(60) == 0
    finally:
        procs[1].kill()
    got = json.loads(outs[0].read_text())
    assert got["group_rank"] == 1  # world rank 0 is the reversed group's rank 1
    assert got["gathered"] == [1.0, 0.0]  # gathered in the group's order, not torch's sorted one
    assert got["error"] is not None and "all_reduce on rank 0 of 2 failed" in got["error"]
    assert 1.5 < got["seconds"] < 10, got  # the world's 2 s, not torch's 30-minute default for new groups
