"""Tensor parallelism over Ray actors: a two-node Ray cluster on this host (two ``ray start``
processes, each its own Ray node with its own custom resource), TP=2 with the worker rank pinned to
the second node gives TP=1's greedy tokens; a killed actor fails the engine naming the rank and
Ray's death cause; no Ray, no cluster or resources the cluster lacks fail fast, naming the fix."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from plinth import LLM, SamplingParams
from plinth.config import EngineConfig
from plinth.parallel.executor import WorkerFailure, free_port
from plinth_conformance.tiny_models import assert_same_generations, prompts, save_tiny_model

ray = pytest.importorskip("ray", reason="the Ray executor's tests need `pip install ray`")

from plinth.parallel import ray_executor  # noqa: E402 - after the skip
from plinth.parallel.ray_executor import RayClusterError, RayExecutor, collectives_interface  # noqa: E402

ENGINE: dict[str, Any] = dict(
    num_kv_blocks=64, block_size=16, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8, backend="cpu"
)
#: fp32 on both sides; only the order of the sums differs (partial products all-reduced)
LOGPROB_TOL = 1e-4
RAY = Path(sys.executable).parent / "ray"
QUIET = {"RAY_USAGE_STATS_ENABLED": "0"}


@dataclass(frozen=True)
class Cluster:
    """The private two-node cluster: its GCS address, and each node's id by its custom resource."""

    address: str
    node_ids: dict[str, str]  # "node_a" / "node_b" -> Ray node id


def _ray_start(*args: str, temp_dir: str) -> None:
    env = {**os.environ, **QUIET}
    cmd = [str(RAY), "start", *args, "--num-cpus=1", "--object-store-memory=100000000", f"--temp-dir={temp_dir}"]
    subprocess.run(cmd, env=env, check=True, timeout=60, capture_output=True)


def _stop(temp_dir: str) -> None:
    """Stop only this cluster's processes (each names our private temp dir), by pid: a plain
    ``ray stop`` would stop every Ray process of this user on the host."""
    mine = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and proc.name != str(os.getpid()):
            with contextlib.suppress(OSError):
                if temp_dir.encode() in (proc / "cmdline").read_bytes():
                    mine.append(int(proc.name))
    for pid in mine:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 3  # then kill: a graceful stop of Ray's services takes 10 s and more
    while mine and time.monotonic() < deadline:
        mine = [pid for pid in mine if Path(f"/proc/{pid}").exists() and not _zombie(pid)]
        time.sleep(0.2)
    for pid in mine:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z")
    return False


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two Ray nodes on this host: the head (``node_a``) and a second one (``node_b``), one core each."""
    temp_dir = tempfile.mkdtemp(prefix="plinth-ray-", dir="/tmp")  # short: Ray's socket paths must fit
    port = free_port()
    try:
        # one GPU each as far as Ray knows (none is there: a GPU only Ray's placement sees)
        _ray_start("--head", f"--port={port}", "--resources={\"node_a\": 1}", "--include-dashboard=false",
                   "--num-gpus=1", temp_dir=temp_dir)  # fmt: skip
        _ray_start(f"--address=127.0.0.1:{port}", '--resources={"node_b": 1}', "--num-gpus=1", temp_dir=temp_dir)
        address = f"127.0.0.1:{port}"
        ray.init(address=address, logging_level="WARNING")
        try:
            node_ids = {
                name: node["NodeID"] for node in ray.nodes() if node["Alive"] for name in ("node_a", "node_b")
                if name in node["Resources"]
            }  # fmt: skip
        finally:
            ray.shutdown()
        assert set(node_ids) == {"node_a", "node_b"} and node_ids["node_a"] != node_ids["node_b"]
        yield Cluster(address, node_ids)
    finally:
        _stop(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _generate(llm: LLM) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    return llm.generate(prompts(0, (1, 9, 17, 40)), params)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's folder (2 layers, 4 heads, 2 KV heads): splits over two ranks either way."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="module")
def single_process(llama: Path) -> list[Any]:
    """What one process generates: the reference every Ray run must equal."""
    llm = LLM(model=str(llama), **ENGINE)
    try:
        return _generate(llm)
    finally:
        llm.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_two_ranks_over_ray_give_the_single_process_tokens_with_the_worker_on_the_second_node(
    sizes: dict[str, Any], cluster: Cluster, llama: Path, single_process: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    monkeypatch.setenv("PLINTH_RAY_RESOURCES", '{"node_b": 1}')  # the driver's node is node_a (the head)
    t0 = time.monotonic()
    llm = LLM(model=str(llama), distributed_executor="ray", num_threads=1, **sizes, **ENGINE)
    started = time.monotonic() - t0
    executor = llm.engine.executor
    try:
        assert isinstance(executor, RayExecutor) and len(executor.actors) == 1
        assert executor.driver_node.node_id == cluster.node_ids["node_a"]
        assert executor.nodes[0].node_id == cluster.node_ids["node_b"] != executor.driver_node.node_id
        assert_same_generations(_generate(llm), single_process, LOGPROB_TOL)
    finally:
        t1 = time.monotonic()
        llm.engine.close()
        closed = time.monotonic() - t1
    assert not ray.is_initialized()  # the executor connected, so it disconnected
    assert closed < 15, closed
    print(f"ray {sizes}: started in {started:.1f}s, closed in {closed:.1f}s")


@pytest.mark.slow
def test_a_device_per_rank_is_reserved_and_rank_0s_stays_on_its_own_node(
    cluster: Cluster, llama: Path, single_process: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a device resource (the GPU backends declare "GPU"; here named by PLINTH_RAY_DEVICE over
    Ray's bookkeeping GPUs, which the cpu backend ignores) each rank reserves one: the worker's bundle
    on node_b, rank 0's on the driver's node through a holder actor, so no worker gets rank 0's."""
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    monkeypatch.setenv("PLINTH_RAY_RESOURCES", '{"node_b": 1}')
    monkeypatch.setenv("PLINTH_RAY_DEVICE", "GPU")
    llm = LLM(model=str(llama), distributed_executor="ray", num_threads=1, tensor_parallel_size=2, **ENGINE)
    executor = llm.engine.executor
    try:
        assert isinstance(executor, RayExecutor) and executor.holder is not None
        assert executor.driver_node.node_id == cluster.node_ids["node_a"] and executor.driver_node.devices == ("0",)
        assert executor.local_rank == 0  # rank 0 binds the device Ray gave its holder
        assert executor.nodes[0].node_id == cluster.node_ids["node_b"] and executor.nodes[0].devices == ("0",)
        assert_same_generations(_generate(llm), single_process, LOGPROB_TOL)
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_a_killed_actor_fails_the_engine_naming_the_rank_and_the_death_cause(
    cluster: Cluster, llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    monkeypatch.setenv("PLINTH_RAY_PLACEMENT", "PACK")
    llm = LLM(model=str(llama), tensor_parallel_size=2, distributed_executor="ray", num_threads=1, **ENGINE)
    try:
        llm.generate([prompts(1, (5,))[0]], SamplingParams(temperature=0, max_tokens=2))  # one round trip
        executor = llm.engine.executor
        assert isinstance(executor, RayExecutor) and executor.alive()
        ray.kill(executor.actors[0])
        t0 = time.monotonic()
        with pytest.raises(
            WorkerFailure, match=r"rank 1 \(Ray actor on [\d.]+, pid \d+\): the actor died: .*killed by `ray\.kill`"
        ):
            llm.generate(prompts(2, (9, 9)), SamplingParams(temperature=0, max_tokens=8))
        assert time.monotonic() - t0 < 15
        assert not executor.alive()
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_a_hung_actor_fails_the_engine_at_the_timeout_and_close_stays_bounded(
    cluster: Cluster, llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    llm = LLM(model=str(llama), tensor_parallel_size=2, distributed_executor="ray", distributed_timeout_s=4.0, **ENGINE)
    executor = llm.engine.executor
    assert isinstance(executor, RayExecutor)
    pid = executor.nodes[0].pid  # on this host: both Ray nodes run here
    try:
        llm.generate([prompts(1, (5,))[0]], SamplingParams(temperature=0, max_tokens=2))
        os.kill(pid, signal.SIGSTOP)  # alive, holding its sockets, answering nothing
        t0 = time.monotonic()
        with pytest.raises(WorkerFailure, match="rank 0 of 2 failed|timed out|Timed out"):
            llm.generate(prompts(2, (9,)), SamplingParams(temperature=0, max_tokens=8))
        elapsed = time.monotonic() - t0
        assert 3.0 < elapsed < 30, elapsed
    finally:
        t1 = time.monotonic()
        llm.engine.close()  # the goodbye times out (4 s), then the actor is killed, stopped or not
        closed = time.monotonic() - t1
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert closed < 15, closed


@pytest.mark.slow
def test_resources_the_cluster_lacks_fail_at_the_timeout_naming_them(
    cluster: Cluster, llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    monkeypatch.setenv("PLINTH_RAY_RESOURCES", '{"node_c": 1}')
    t0 = time.monotonic()
    with pytest.raises(RayClusterError, match=r"did not place 1 worker rank.*node_c: 1 wanted, 0 in the cluster"):
        LLM(model=str(llama), tensor_parallel_size=2, distributed_executor="ray", distributed_timeout_s=2, **ENGINE)
    assert time.monotonic() - t0 < 20
    assert not ray.is_initialized()


@pytest.mark.slow
def test_an_actor_that_cannot_start_names_its_rank_and_the_root_error(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node whose Python lacks what the actor needs (here: a module only the driver can import)."""
    (tmp_path / "driver_only.py").write_text("class Worker:\n    def node(self) -> None: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import driver_only

    monkeypatch.setattr(ray_executor, "RayWorker", driver_only.Worker)
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"rank 1's Ray actor did not start: ModuleNotFoundError: .*driver_only"):
        RayExecutor(EngineConfig(distributed_timeout_s=20), 2)
    assert time.monotonic() - t0 < 15
    assert not ray.is_initialized()


@pytest.mark.slow
def test_a_rank_that_raised_is_named_with_its_own_error(cluster: Cluster) -> None:
    """A worker loop that raised (e.g. its shard would not fit rank 0's KV setup): Ray hands rank 0
    the remote exception; ``diagnose`` names the rank, where it ran and the original error."""

    def worker_loop() -> None:  # local: Ray ships it by value, no import on the worker
        raise RuntimeError("rank 1 would run (block size, dtype, kv dtype) (32, 'float32', 'float32')")

    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        executor = RayExecutor.__new__(RayExecutor)  # only what diagnose reads: the runs and their nodes
        executor.ray, executor._runs = ray, [ray.remote(worker_loop).remote()]
        executor.nodes = [ray_executor.RayNode("n", "10.0.0.7", 4242)]
        assert executor.diagnose("broadcast of the step from rank 0 failed") == (
            "broadcast of the step from rank 0 failed; rank 1 (Ray actor on 10.0.0.7, pid 4242): "
            "RuntimeError: rank 1 would run (block size, dtype, kv dtype) (32, 'float32', 'float32')"
        )
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_no_cluster_running_fails_fast_naming_the_fix(llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not ray.is_initialized()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(RayClusterError, match=r"no Ray cluster is running at RAY_ADDRESS=.*ray start --head"):
        LLM(model=str(llama), tensor_parallel_size=2, distributed_executor="ray", **ENGINE)
    assert time.monotonic() - t0 < 15


def test_without_ray_installed_the_error_says_pip_install_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(RayClusterError, match="not installed: pip install ray"):
        RayExecutor(EngineConfig(), 2)


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("PLINTH_RAY_PLACEMENT", "SCATTER", "PLINTH_RAY_PLACEMENT='SCATTER' is not one of SPREAD, PACK, STRICT_SPREAD"),
        ("PLINTH_RAY_RESOURCES", "{node_b: 1}", "PLINTH_RAY_RESOURCES='{node_b: 1}' is not JSON"),
        ("PLINTH_RAY_RESOURCES", '{"node_b": -1}', "must be a JSON object of positive numbers"),
        ("PLINTH_RAY_RESOURCES", '{"CPU": 2}', "must not set 'CPU'"),
    ],
)
def test_bad_placement_settings_are_refused_naming_the_variable(
    name: str, value: str, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        RayExecutor(EngineConfig(), 2)


def test_the_collectives_are_bound_to_the_node_ip_only_where_the_host_name_resolves_to_the_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the host's name resolves to 127.0.0.1 (many /etc/hosts), the collectives would advertise
    the loopback to the other machines: the interface holding the Ray node's IP is named instead."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(ray_executor, "_interface_holding", lambda ip: {"10.1.2.3": "eth7"}.get(ip))
    monkeypatch.setattr(ray_executor.socket, "gethostbyname", lambda name: "127.0.1.1")
    assert collectives_interface("10.1.2.3") == "eth7"
    assert collectives_interface("127.0.0.1") is None  # a one-host cluster on the loopback: nothing to do
    assert collectives_interface("10.9.9.9") is None  # no interface holds it: a warning names the variable
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bond0")
    assert collectives_interface("10.1.2.3") is None  # the user's choice stands
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(ray_executor.socket, "gethostbyname", lambda name: "10.1.2.3")
    assert collectives_interface("10.1.2.3") is None  # the name resolves to a reachable address


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interface lookup by SIOCGIFADDR is Linux's")
def test_the_loopback_interface_is_found_by_its_address() -> None:
    assert ray_executor._interface_holding("127.0.0.1") is not None
    assert ray_executor._interface_holding("203.0.113.254") is None  # TEST-NET-3: held by no interface here


def test_a_ray_error_is_named_by_its_root_cause() -> None:
    """Ray's errors carry the remote traceback (with colour codes); the innermost raise is what counts."""
    text = (
        "The actor died because of an error raised in its creation task, \x1b[36mray::W.__init__()\x1b[39m\n"
        "     ^^^^^^^\nRuntimeError: The actor with name W failed to import on the worker:\n\n"
        "ModuleNotFoundError: No module named 'plinth'"
    )
    assert ray_executor._root_error(RuntimeError(text)) == "ModuleNotFoundError: No module named 'plinth'"
    assert ray_executor._root_error(RuntimeError("no traceback here\n  at all")) == "no traceback here"
