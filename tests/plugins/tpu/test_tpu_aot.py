"""Ahead-of-time TPU compiles (v5e, v6e) without a TPU: needs libtpu (``jax[tpu]``); ~40 s."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from plinth_tpu.aot import (
    DEFAULT_BUCKETS,
    SPMD_BUCKET,
    SPMD_SIZES,
    TARGETS,
    AttentionBucket,
    compile_only_device,
    compile_only_devices,
    compile_record,
    compile_spmd_layer,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None, reason="libtpu not installed (pip install 'jax[tpu]==0.10.2')"
    ),
]


def test_v5e_and_v6e_compile_every_default_bucket() -> None:
    assert len(DEFAULT_BUCKETS) >= 3
    record = compile_record()
    assert set(record) == {"v5e", "v6e"}
    for target, entries in record.items():
        assert entries["gemm"] == "compiled", (target, entries["gemm"])
        compiled = [
            label
            for label, result in entries.items()
            if label != "gemm" and not label.startswith("spmd-") and result == "compiled"
        ]
        assert compiled == [b.label() for b in DEFAULT_BUCKETS], (target, entries)
        for size in SPMD_SIZES:
            assert entries[f"spmd-tp{size}/{SPMD_BUCKET.label()}"] == "compiled", (target, entries)


@pytest.mark.parametrize("size", SPMD_SIZES)
def test_the_spmd_layer_compiles_over_a_mesh_with_one_all_reduce_and_nothing_else(size: int) -> None:
    """The grouped q/k/v rows and the per-chip attention leave the partitioner nothing to move but
    o_proj's partial sums: a wrong grouping or a replicated kernel would add gathers or permutes."""
    found = compile_spmd_layer(SPMD_BUCKET, compile_only_devices(TARGETS["v5e"]), size)
    assert found == {"all-reduce": 1, "all-gather": 0, "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 0}


def test_a_tiling_violation_is_caught_ahead_of_time() -> None:
    """The lane proves it compiles for real: a block of 64 lanes on a 256-lane array must fail."""
    device = compile_only_device(TARGETS["v6e"])

    def copy(x_ref: jax.Array, o_ref: jax.Array) -> None:
        o_ref[...] = x_ref[...]

    def tiled(lanes: int):  # type: ignore[no-untyped-def]
        return pl.pallas_call(
            copy,
            grid=(2, 256 // lanes),
            in_specs=[pl.BlockSpec((8, lanes), lambda i, j: (i, j))],
            out_specs=pl.BlockSpec((8, lanes), lambda i, j: (i, j)),
            out_shape=jax.ShapeDtypeStruct((16, 256), jnp.float32),
        )

    arg = jax.ShapeDtypeStruct((16, 256), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    jax.jit(tiled(128)).lower(arg).compile()  # the same kernel with whole lanes compiles
    with pytest.raises(ValueError, match="divisible by 8 and 128"):
        jax.jit(tiled(64)).lower(arg).compile()


def test_a_missing_topology_is_recorded_not_raised() -> None:
    record = compile_record({"v99": "v99:2x2"}, [AttentionBucket(16, 4, 4)])
    assert "topology" in record["v99"] and record["v99"]["topology"] != "compiled"
