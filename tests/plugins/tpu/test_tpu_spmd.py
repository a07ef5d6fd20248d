"""SPMD tensor parallelism on the tpu backend (plugin API 1.12), on a mesh of JAX CPU devices.

One process drives the mesh: the core loads the whole model with its fused rows grouped by
shard, the backend places the weights and caches by the core's plan, XLA partitions the step and
the Pallas attention runs per device under ``shard_map`` (interpreter mode). Each case runs in a
process of its own: ``--xla_force_host_platform_device_count`` is read once, when JAX starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_tpu_backend import save_tiny

from plinth.platform.values import SpmdPlan

HERE = Path(__file__).parent


def _run(folder: Path, devices: int, dtype: str = "float32") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(
        PLINTH_TPU_INTERPRET="1", JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}"
    )
    return subprocess.run(
        [sys.executable, str(HERE / "spmd_run.py"), str(folder), dtype],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


def _result(folder: Path, dtype: str = "float32") -> dict[str, Any]:
    done = _run(folder, 2, dtype)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_two_device_mesh_gives_the_one_device_generations_holding_half_of_each_split(
    kind: str, tmp_path: Path
) -> None:
    save_tiny(kind, tmp_path)  # 4 heads, 2 KV heads of 64, 2 layers; Qwen2: q/k/v bias
    r = _result(tmp_path)
    assert not r["executor"]  # no worker processes: one process, two devices
    assert r["devices"] == ["cpu:0", "cpu:1"]
    assert r["qkv"] == [[512, 128], [[256, 128], [256, 128]]]  # by output: each device its heads' rows
    assert r["down"] == [[128, 256], [[128, 128], [128, 128]]]  # by input
    assert r["norm"] == [[128], [[128], [128]]]  # replicated
    assert r["cache"] == [[96, 16, 4, 1, 128], [[96, 16, 2, 1, 128], [96, 16, 2, 1, 128]]]  # one KV head each
    # XLA's partitioner summed the row-parallel GEMMs' partial products: at least o_proj and
    # down_proj of each of the 2 layers
    assert r["collectives"]["all-reduce"] >= 4, r["collectives"]
    assert r["compilations_after_warmup"] == 0
    print(f"{kind}: worst top-5 logprob difference {r['worst']:.2g}; {r['collectives']}; seconds {r['seconds']}")


@pytest.mark.slow
def test_bfloat16_packed_caches_split_by_head(tmp_path: Path) -> None:
    """bf16 packs K and V of a head into one 32-bit word: the head axis is then Hkv itself."""
    save_tiny("llama", tmp_path)
    r = _result(tmp_path, "bfloat16")
    assert r["cache"] == [[96, 16, 2, 2, 128], [[96, 16, 1, 2, 128], [96, 16, 1, 2, 128]]]


def test_too_few_devices_are_named_with_the_flag_that_makes_more(tmp_path: Path) -> None:
    save_tiny("llama", tmp_path)
    done = _run(tmp_path, 1)
    assert done.returncode != 0
    assert "tensor_parallel_size 2 needs 2 devices; jax sees 1 cpu device(s)" in done.stderr
    assert "--xla_force_host_platform_device_count" in done.stderr


def test_the_plan_places_weights_by_its_splits_and_replicates_what_does_not_divide() -> None:
    import jax
    from jax.sharding import PartitionSpec as P
    from plinth_tpu.spmd import cache_sharding, make_mesh, weight_sharding

    devices = jax.devices("cpu")
    with pytest.raises(ValueError, match=r"needs 2 devices; jax sees 1"):
        make_mesh(devices[:1], 2, interpret=True)
    mesh = make_mesh(devices * 2, 2, interpret=True)  # placements only: one device twice will do
    plan = SpmdPlan(2, {"a": "out", "b": "in", "odd": "out"}, 2)
    assert weight_sharding("a", (8, 4), plan, mesh).spec == P("tp", None)
    assert weight_sharding("b", (8, 4), plan, mesh).spec == P(None, "tp")
    assert weight_sharding("odd", (7, 4), plan, mesh).spec == P(None, None)  # 7 rows: whole
    assert weight_sharding("norm", (8,), plan, mesh).spec == P(None)
    assert cache_sharding((3, 16, 4, 1, 128), mesh).spec == P(None, None, "tp", None, None)
    with pytest.raises(ValueError, match="does not split by head over 2 devices"):
        cache_sharding((3, 16, 3, 1, 128), mesh)
