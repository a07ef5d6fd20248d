"""Ahead-of-time compiles for real TPU targets on a machine without a TPU.

libtpu (``pip install 'jax[tpu]==0.10.2'``) carries the whole TPU compiler, Mosaic included.
``jax.experimental.topologies.get_topology_desc("v5e:2x2", "tpu")`` gives compile-only devices
of that chip; arguments placed on one of them (``ShapeDtypeStruct(..., sharding=...)``) make
``jax.jit(f).lower(...).compile()`` a real TPU compile: tiling violations, VMEM overflows and
unsupported Mosaic ops fail here exactly as on the chip. Nothing is executed. The SPMD path (API
1.12) is compiled the same way over meshes of the slice's chips (:func:`compile_spmd_layer`).

:func:`compile_record` returns ``{target: {bucket: "compiled" | error text}}`` for the
certificate. Run it with ``JAX_PLATFORMS=cpu`` (no TPU runtime is started for it).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from plinth_tpu.gemm import dense_linear, int8_linear, prepare_dense, prepare_int8
from plinth_tpu.layout import kv_cache_shape
from plinth_tpu.ragged_attention import ragged_paged_attention

#: TPU targets the backend certifies compiles for, as ``jax.experimental.topologies`` names them.
#: A 2x2 slice is the smallest these names accept with the default chips-per-host bounds.
TARGETS: dict[str, str] = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}


@dataclass(frozen=True, slots=True)
class AttentionBucket:
    """One compiled shape: padded tokens, sequences and blocks per sequence, and the model's heads."""

    num_tokens: int
    num_seqs: int
    blocks_per_seq: int
    num_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 128
    block_size: int = 16
    num_blocks: int = 256
    dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    sliding_window: int | None = None
    soft_cap: float | None = None

    def label(self) -> str:
        """A stable key for the record, e.g. ``t64-s8-w16-h8/2x128-bs16-bfloat16/bfloat16``."""
        extra = (f"-sw{self.sliding_window}" if self.sliding_window else "") + (
            f"-cap{self.soft_cap:g}" if self.soft_cap else ""
        )
        return (
            f"t{self.num_tokens}-s{self.num_seqs}-w{self.blocks_per_seq}-h{self.num_heads}/{self.num_kv_heads}"
            f"x{self.head_size}-bs{self.block_size}-{self.dtype}/{self.kv_dtype}{extra}"
        )


DEFAULT_BUCKETS: tuple[AttentionBucket, ...] = (
    AttentionBucket(16, 16, 8),
    AttentionBucket(64, 16, 16),
    AttentionBucket(256, 32, 32),
    AttentionBucket(64, 16, 16, dtype="float32", kv_dtype="float32"),
    AttentionBucket(64, 8, 8, num_heads=6, num_kv_heads=2, head_size=80),  # GQA 3, a head padded 80 -> 128
    AttentionBucket(64, 8, 16, num_heads=12, num_kv_heads=4, head_size=64, sliding_window=100, soft_cap=50.0),
)


#: SPMD (plugin API 1.12): a layer's attention half compiled over meshes of these sizes (chips of
#: the 2x2 slice), the heads splitting evenly over 4.
SPMD_SIZES: tuple[int, ...] = (2, 4)
SPMD_BUCKET = AttentionBucket(64, 16, 16, num_heads=8, num_kv_heads=4)


def compile_only_devices(topology: str) -> list[jax.Device]:
    """The compile-only devices of a TPU topology such as ``"v6e:2x2"``."""
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(topology, "tpu").devices)


def compile_only_device(topology: str) -> jax.Device:
    """The first compile-only device of a TPU topology such as ``"v6e:2x2"``."""
    return compile_only_devices(topology)[0]


def compile_spmd_layer(bucket: AttentionBucket, devices: Sequence[jax.Device], size: int) -> dict[str, int]:
    """Compile a layer's attention half as the SPMD path runs it, over a mesh of ``size`` chips:
    the fused q/k/v GEMM split by output (rows grouped by shard), the Pallas attention per chip
    under ``shard_map`` (Mosaic), ``o_proj`` split by input; returns the collectives XLA inserted.

    :raises RuntimeError: the partitioner inserted no all-reduce after ``o_proj`` (the plan was lost).
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from plinth_tpu.spmd import AXIS, cache_sharding, collectives, make_mesh, per_device_attention, replicated

    b = bucket
    mesh = make_mesh(devices, size, interpret=False)
    hidden = 512
    q_size, kv_size = b.num_heads * b.head_size, b.num_kv_heads * b.head_size
    attend = per_device_attention(ragged_paged_attention, mesh)
    static = dict(scale=b.head_size**-0.5, block_size=b.block_size, sliding_window=None, soft_cap=None, interpret=False)

    def layer(x: jax.Array, w_qkv: jax.Array, w_o: jax.Array, cache: jax.Array, *meta: jax.Array) -> tuple:
        t = x.shape[0]
        qkv = jnp.dot(x, w_qkv.T).reshape(t, size, -1)  # group r: shard r's q, k, v
        q, k, v = jnp.split(qkv, [q_size // size, (q_size + kv_size) // size], axis=-1)
        q = q.reshape(t, b.num_heads, b.head_size)
        k = k.reshape(t, b.num_kv_heads, b.head_size)
        v = v.reshape(t, b.num_kv_heads, b.head_size)
        out, cache = attend(q, k, v, cache, *meta, **static)
        return jnp.dot(out.reshape(t, q_size), w_o.T), cache

    def at(shape: Sequence[int], dtype: DTypeLike, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)

    whole = replicated(mesh)
    cache_shape = kv_cache_shape(b.num_blocks, b.block_size, b.num_kv_heads, b.head_size, b.kv_dtype)
    cache_at = cache_sharding(tuple(cache_shape), mesh)
    i32 = jnp.int32
    args = (
        at((b.num_tokens, hidden), b.dtype, whole),
        at((q_size + 2 * kv_size, hidden), b.dtype, NamedSharding(mesh, P(AXIS, None))),
        at((hidden, q_size), b.dtype, NamedSharding(mesh, P(None, AXIS))),
        at(cache_shape, b.kv_dtype, cache_at),
        at((b.num_tokens,), i32, whole),
        at((b.num_seqs, b.blocks_per_seq), i32, whole),
        at((b.num_seqs,), i32, whole),
        at((b.num_seqs + 1,), i32, whole),
        at((3,), i32, whole),
    )
    jitted = jax.jit(layer, donate_argnums=(3,), out_shardings=(whole, cache_at))
    found = collectives(jitted.lower(*args).compile().as_text() or "")
    if not found["all-reduce"]:
        raise RuntimeError(f"no all-reduce after the row-parallel o_proj over {size} chips: {found}")
    return found


def _struct(shape: Sequence[int], dtype: DTypeLike, device: jax.Device) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=jax.sharding.SingleDeviceSharding(device))


def compile_attention(bucket: AttentionBucket, device: jax.Device) -> None:
    """Lower and compile the ragged attention (Mosaic, not interpreted) for ``bucket`` on ``device``."""
    b = bucket
    s = functools.partial(_struct, device=device)
    i32 = jnp.int32
    args = (
        s((b.num_tokens, b.num_heads, b.head_size), b.dtype),
        s((b.num_tokens, b.num_kv_heads, b.head_size), b.dtype),
        s((b.num_tokens, b.num_kv_heads, b.head_size), b.dtype),
        s(kv_cache_shape(b.num_blocks, b.block_size, b.num_kv_heads, b.head_size, b.kv_dtype), b.kv_dtype),
        s((b.num_tokens,), i32),
        s((b.num_seqs, b.blocks_per_seq), i32),
        s((b.num_seqs,), i32),
        s((b.num_seqs + 1,), i32),
        s((3,), i32),
    )
    fn = functools.partial(
        ragged_paged_attention,
        scale=b.head_size**-0.5,
        block_size=b.block_size,
        sliding_window=b.sliding_window,
        soft_cap=b.soft_cap,
        interpret=False,
    )
    jax.jit(fn, donate_argnums=(3,)).lower(*args).compile()


def compile_gemms(device: jax.Device, *, tokens: int = 64, in_features: int = 256, out_features: int = 512) -> None:
    """Compile a tiny dense (bf16, f32) and int8 weight-only GEMM for ``device``."""
    s = functools.partial(_struct, device=device)
    weight, bias = jnp.zeros((out_features, in_features)), jnp.zeros(out_features)
    for dtype in ("float32", "bfloat16"):
        dense = jax.eval_shape(functools.partial(prepare_dense, dtype=dtype), weight, bias)
        dense = jax.tree.map(lambda a: s(a.shape, a.dtype), dense)
        jax.jit(dense_linear).lower(s((tokens, in_features), dtype), dense).compile()
        q = jax.eval_shape(functools.partial(prepare_int8, dtype=dtype), weight, bias)
        q = jax.tree.map(lambda a: s(a.shape, a.dtype), q)
        jax.jit(int8_linear).lower(s((tokens, in_features), dtype), q).compile()


def _attempt(fn: Callable[[], None]) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the record carries the compiler's own message
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        return f"{type(exc).__name__}: {first[:500]}", time.perf_counter() - start
    return "compiled", time.perf_counter() - start


def compile_record(
    targets: dict[str, str] | None = None,
    buckets: Iterable[AttentionBucket] = DEFAULT_BUCKETS,
    *,
    timings: dict[str, dict[str, float]] | None = None,
    spmd_sizes: Sequence[int] = SPMD_SIZES,
) -> dict[str, dict[str, str]]:
    """``{target: {bucket label | "gemm" | "spmd-tpN/label": "compiled" | error text}}`` for every
    target and bucket, and the SPMD layer over each of ``spmd_sizes`` chips.

    A target whose topology cannot be made (no libtpu) records that error under ``"topology"``.
    ``timings``, when given, is filled with the seconds each compile took.
    """
    record: dict[str, dict[str, str]] = {}
    buckets = tuple(buckets)
    for target, topology in (targets or TARGETS).items():
        try:
            devices = compile_only_devices(topology)
        except Exception as exc:  # noqa: BLE001 - reported in the record, not swallowed
            record[target] = {"topology": f"{type(exc).__name__}: {exc}"}
            continue
        device = devices[0]
        entries: dict[str, str] = {}
        times: dict[str, float] = {}
        for bucket in buckets:
            entries[bucket.label()], times[bucket.label()] = _attempt(
                functools.partial(compile_attention, bucket, device)
            )
        entries["gemm"], times["gemm"] = _attempt(functools.partial(compile_gemms, device))
        for size in spmd_sizes:
            key = f"spmd-tp{size}/{SPMD_BUCKET.label()}"
            entries[key], times[key] = _attempt(functools.partial(compile_spmd_layer, SPMD_BUCKET, devices, size))
        record[target] = entries
        if timings is not None:
            timings[target] = times
    return record


def main(argv: list[str] | None = None) -> int:
    """``python -m plinth_tpu.aot [--out FILE]``: compile every target and bucket; print (or write) the record."""
    import argparse
    import json
    import os
    from datetime import date

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    parser = argparse.ArgumentParser(description="ahead-of-time TPU compiles of the tpu backend's kernels")
    parser.add_argument("--out", default=None, help="write the record (with times and versions) here as JSON")
    args = parser.parse_args(argv)
    spent: dict[str, dict[str, float]] = {}
    record = compile_record(timings=spent)
    doc = {
        "date": date.today().isoformat(),
        "jax": jax.__version__,
        "targets": TARGETS,
        "record": record,
        "seconds": {t: {k: round(v, 2) for k, v in d.items()} for t, d in spent.items()},
    }
    text = json.dumps(doc, indent=2) + "\n"
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    print(text, end="")
    failed = [f"{t}/{b}" for t, entries in record.items() for b, v in entries.items() if v != "compiled"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
