"""The cpu backend's communicator on two real ranks (processes on the loopback): its all-reduce runs
through shared memory (the same sums as the oracle, in place, strided views untouched around them),
everything else through gloo; a dead peer fails the wait at once; ``PLINTH_CPU_SHM_ALLREDUCE=0`` keeps
gloo; no segment file outlives the start."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from plinth.parallel.executor import free_port

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or not Path("/dev/shm").is_dir(), reason="the shared-memory path is x86-64 Linux"
)

_RANK = textwrap.dedent(
    """
    import json, os, sys, time, torch
    from plinth.parallel.comm import CollectiveError, close_world, init_world
    from plinth_cpu.backend import CpuServices
    rank, init, out, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    init_world(init, 2, rank, 30.0)
    comm = CpuServices().communicator(2, rank, None)
    result = {"kind": type(comm).__name__, "segments": sorted(os.listdir("/dev/shm"))}
    if mode == "die":
        if rank == 1:
            os._exit(3)  # gone before the all-reduce rank 0 waits in
        t0 = time.monotonic()
        try:
            comm.all_reduce(torch.ones(8))
        except CollectiveError as e:
            result["error"], result["seconds"] = str(e), time.monotonic() - t0
    else:
        sums = []
        for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float16)):
            base = torch.full((12, 10), 100.0, dtype=dtype)
            view = base[1::2, ::3]  # strided
            view.copy_(torch.arange(24, dtype=torch.float32).view(6, 4) * (rank + 1) + i)
            out_t = comm.all_reduce(view)
            mask = torch.zeros(12, 10, dtype=torch.bool)
            mask[1::2, ::3] = True
            sums.append({"same": out_t.data_ptr() == view.data_ptr(), "values": view.float().flatten().tolist(),
                         "outside": bool((base[~mask] == 100.0).all())})
        big = torch.ones(700_000) * (rank + 1)  # 2.8 MB: past a slot, through gloo
        sums.append({"big": comm.all_reduce(big)[:3].tolist()})
        result["gathered"] = comm.all_gather(torch.tensor([float(rank)]), dim=0).tolist()
        result["sums"] = sums
        t0 = time.perf_counter()
        x = torch.randn(8, 512)
        for _ in range(200):
            comm.all_reduce(x.mul_(0.5))
        result["us_per_call"] = (time.perf_counter() - t0) / 200 * 1e6
    json.dump(result, open(out, "w"))
    close_world()
    """
)


def _run(tmp_path: Path, mode: str, env: dict[str, str] | None = None) -> list[dict]:
    init = f"tcp://127.0.0.1:{free_port()}"
    outs = [tmp_path / f"{mode}{r}.json" for r in range(2)]
    full_env = {**os.environ, **(env or {})}
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK, str(r), init, str(outs[r]), mode], env=full_env)
        for r in range(2)
    ]
    for p in procs:
        p.wait(90)
    return [json.loads(o.read_text()) for o in outs if o.exists()]


@pytest.mark.slow
def test_the_all_reduce_goes_through_shared_memory_and_sums_like_the_oracle(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "sum")
    assert len(ranks) == 2 and all(r["kind"] == "SharedMemoryCommunicator" for r in ranks)
    want = [[3.0 * v + 2 * i for v in range(24)] for i in range(3)]  # rank 0's (v + i) plus rank 1's (2v + i)
    for r in ranks:
        for i in range(3):
            s = r["sums"][i]
            assert s["same"] and s["outside"], s  # in place, nothing beside the strided view touched
            assert s["values"] == want[i], (i, s["values"])  # exact: small integers in every dtype
        assert r["sums"][3]["big"] == [3.0, 3.0, 3.0]  # the gloo fallback
        assert r["gathered"] == [0.0, 1.0]
        print(f"rank {r['gathered']} shared-memory all-reduce [8, 512] fp32: {r['us_per_call']:.1f} us a call")
    assert not any(s.startswith("plinth-allreduce-") for s in os.listdir("/dev/shm"))  # unlinked at start


@pytest.mark.slow
def test_a_dead_peer_fails_the_wait_at_once_naming_it(tmp_path: Path) -> None:
    t0 = time.monotonic()
    ranks = _run(tmp_path, "die")
    assert len(ranks) == 1, ranks  # the dead rank wrote nothing
    assert "rank 1" in ranks[0]["error"] and "is gone" in ranks[0]["error"]
    assert ranks[0]["seconds"] < 5 and time.monotonic() - t0 < 60


@pytest.mark.slow
def test_switched_off_by_the_environment_it_stays_gloo(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "sum", {"PLINTH_CPU_SHM_ALLREDUCE": "0"})
    assert [r["kind"] for r in ranks] == ["TorchDistributedCommunicator"] * 2
    assert ranks[0]["sums"][0]["values"] == [3.0 * v for v in range(24)]
    print(f"gloo all-reduce [8, 512] fp32: {ranks[0]['us_per_call']:.1f} us a call")
