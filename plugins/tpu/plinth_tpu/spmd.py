"""SPMD tensor parallelism on the tpu backend (plugin API 1.12): one process, a mesh of devices.

The core hands :meth:`TpuServices.compile_step <plinth_tpu.backend.TpuServices.compile_step>` an
:class:`~plinth.platform.values.SpmdPlan`; here it becomes placements on a one-axis
:class:`jax.sharding.Mesh` (``"tp"``): every weight the plan names split along its dimension
(``NamedSharding``), the rest replicated, each layer's KV cache split by KV head. XLA's SPMD
partitioner then compiles the step once for the whole mesh and inserts the all-reduces after the
row-parallel GEMMs and the gathers of the logits. The Pallas attention is a custom call the
partitioner cannot split, so it runs under :func:`jax.shard_map`: each device attends with its own
heads over its own slice of the cache, no exchange.

On CPU (the interpreter mode) a mesh needs several host devices:
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX starts.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from plinth.platform.values import SpmdPlan

logger = logging.getLogger(__name__)

#: The mesh's one axis: tensor parallelism.
AXIS = "tp"
#: The KV cache's head axis in :data:`plinth_tpu.backend.TPU_KV_LAYOUT` (``kv_heads``).
CACHE_HEAD_AXIS = 2
#: Set while a step is traced for a mesh: the attention kernel reads it to run per device.
_ACTIVE: ContextVar[Mesh | None] = ContextVar("plinth_tpu_mesh", default=None)


def make_mesh(devices: Sequence[Any], size: int, *, interpret: bool) -> Mesh:
    """A one-axis mesh of the first ``size`` of ``devices``.

    :raises ValueError: fewer devices than ``size``, naming how many there are (and, on CPU, the
        flag that makes more).
    """
    if len(devices) < size:
        hint = (
            " (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N before the process starts)"
            if interpret
            else ""
        )
        raise ValueError(
            f"tpu: tensor_parallel_size {size} needs {size} devices; jax sees {len(devices)} "
            f"{devices[0].platform if devices else ''} device(s){hint}"
        )
    return Mesh(np.array(list(devices[:size])), (AXIS,))


def active_mesh() -> Mesh | None:
    """The mesh of the step being traced, or None (one device, or an eager call)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def tracing_on(mesh: Mesh | None) -> Iterator[None]:
    """Make ``mesh`` the active one while a step is traced."""
    token = _ACTIVE.set(mesh)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _split_spec(ndim: int, dim: int | None) -> P:
    return P(*(AXIS if i == dim else None for i in range(ndim)))


def weight_sharding(name: str, shape: tuple[int, ...], plan: SpmdPlan, mesh: Mesh) -> NamedSharding:
    """Where weight ``name`` goes: split by output (dim 0) or input (dim 1 of a 2-D weight; the
    q8_0 codes and scales keep the input dim there too) as the plan says; whole on every device
    when the plan names no split or the dimension does not divide (a placement only: XLA computes
    the same step)."""
    how = plan.splits.get(name)
    dim = 0 if how == "out" else 1 if how == "in" and len(shape) == 2 else None
    if dim is not None and shape[dim] % plan.size:
        logger.info("tpu: %s %s does not split %d ways along dim %d: replicated", name, shape, plan.size, dim)
        dim = None
    return NamedSharding(mesh, _split_spec(len(shape), dim))


def cache_sharding(shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    """A layer's KV cache split by KV head (its combined K/V head axis: each device whole heads).

    :raises ValueError: the head axis does not divide over the mesh.
    """
    size = mesh.devices.size
    if shape[CACHE_HEAD_AXIS] % size:
        raise ValueError(f"tpu: a KV cache of shape {shape} does not split by head over {size} devices")
    return NamedSharding(mesh, _split_spec(len(shape), CACHE_HEAD_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    """Whole on every device of ``mesh``."""
    return NamedSharding(mesh, P())


def per_device_attention(fn: Callable[..., tuple[Any, Any]], mesh: Mesh) -> Callable[..., tuple[Any, Any]]:
    """``fn`` (the attention function's signature: ``q, k, v, cache, slots, tables, seq_lens,
    starts, distribution, **static``) run by every device on its own heads and cache slice."""

    def call(*arrays: Any, **static: Any) -> tuple[Any, Any]:
        heads = P(None, AXIS, None)  # [T, heads, D]
        cache = _split_spec(5, CACHE_HEAD_AXIS)
        whole = P()
        specs = (heads, heads, heads, cache, whole, whole, whole, whole, whole)
        inner = functools.partial(fn, **static)
        sharded = jax.shard_map(inner, mesh=mesh, in_specs=specs, out_specs=(heads, cache), check_vma=False)
        return sharded(*arrays)  # type: ignore[no-any-return]

    return call


def collectives(hlo_text: str) -> dict[str, int]:
    """The collective ops in a compiled step's HLO, by kind (what the partitioner inserted)."""
    kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    return {k: hlo_text.count(f" {k}(") + hlo_text.count(f" {k}-start(") for k in kinds}
