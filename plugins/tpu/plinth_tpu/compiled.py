"""Whole-step compilation (API 1.5): the core's step program as one ``jax.jit`` per step shape.

The program (:class:`plinth.platform.backend.StepProgram`) is torch code; here it is traced with
:class:`~plinth_tpu.bridge.JaxTensor` arguments standing for the weights, the KV caches and the
padded inputs, so XLA sees the whole step: every layer's GEMMs, norms and rotary fused around the
Pallas attention calls. The weights and caches live on the jax device from the start; the caches are
donated to each step and replaced by the ones it returns (XLA updates them in place).

Compilations are counted where they happen, in the traced function's Python body (it runs once
per new shape; a hit in jax's persistent cache still traces, so it counts too, but skips XLA).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax.sharding import Mesh

from plinth.platform.backend import CompiledStep, SpmdPlan, StepInputs, StepProgram, StepShape
from plinth_tpu.bridge import JaxTensor
from plinth_tpu.interop import to_jax, to_torch
from plinth_tpu.spmd import cache_sharding, collectives, replicated, tracing_on, weight_sharding

logger = logging.getLogger(__name__)

#: Block copies per copy-on-write call are padded to these counts (one compile each, at warm-up).
COPY_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


def enable_disk_cache(cache_dir: str) -> str:
    """Point jax's persistent compilation cache at ``cache_dir/xla`` (every executable kept)."""
    path = os.path.join(cache_dir, "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def _copy_blocks(caches: list[Any], src: Any, dst: Any) -> list[Any]:
    return [c.at[dst].set(c[src]) for c in caches]


class JaxCompiledStep(CompiledStep):
    """The step program jitted per :class:`StepShape`, holding the weights and KV caches on ``device``.

    :param program: the core's step.
    :param kv_caches: the engine's caches (host tensors in the TPU layout); copied to the device once.
    :param device: the jax device.
    :param cache_dir: jax's persistent compilation cache goes under it; None: none.
    :param mesh: SPMD (API 1.12): the devices the step runs on, ``device`` being the first; the
        weights and caches are placed over it by ``plan`` (see :mod:`plinth_tpu.spmd`).
    :param plan: the core's :class:`SpmdPlan`, with ``mesh``.
    """

    def __init__(
        self,
        program: StepProgram,
        kv_caches: list[torch.Tensor],
        device: jax.Device,
        cache_dir: str | None,
        *,
        mesh: Mesh | None = None,
        plan: SpmdPlan | None = None,
    ) -> None:
        self.program = program
        self.device = device
        self.mesh = mesh
        self.disk_cache = enable_disk_cache(cache_dir) if cache_dir else None
        self.compilations = 0
        self.compile_seconds = 0.0
        self.trace_log: list[StepShape] = []  # the shapes traced, in order
        if mesh is None or plan is None:
            self._weights = {name: jax.device_put(to_jax(t), device) for name, t in program.weights.items()}
            # copies the device owns: a donated buffer must not be one torch still holds
            self._caches = [jax.device_put(jnp.array(to_jax(c), copy=True), device) for c in kv_caches]
            self._inputs_at: Any = device
            self._step = jax.jit(self._traced, static_argnums=(3,), donate_argnums=(1,))
            self._copy = jax.jit(self._traced_copy, donate_argnums=(0,))
            return
        self._weights = {
            name: jax.device_put(to_jax(t), weight_sharding(name, tuple(t.shape), plan, mesh))
            for name, t in program.weights.items()
        }
        cache_at = [cache_sharding(tuple(c.shape), mesh) for c in kv_caches]
        self._caches = [
            jax.device_put(jnp.array(to_jax(c), copy=True), at) for c, at in zip(kv_caches, cache_at, strict=True)
        ]
        self._inputs_at = replicated(mesh)
        # the caches keep their placement step after step (a donated buffer is reused in place)
        self._step = jax.jit(
            self._traced, static_argnums=(3,), donate_argnums=(1,), out_shardings=(replicated(mesh), cache_at)
        )
        self._copy = jax.jit(self._traced_copy, donate_argnums=(0,), out_shardings=cache_at)

    def _traced(
        self, weights: dict[str, Any], caches: list[Any], inputs: dict[str, Any], shape: StepShape
    ) -> tuple[Any, list[Any]]:
        self.compilations += 1  # Python runs only while tracing: once per new shape
        self.trace_log.append(shape)
        with torch.inference_mode(), tracing_on(self.mesh):
            logits, new = self.program(
                {k: JaxTensor(v) for k, v in weights.items()},
                [JaxTensor(c) for c in caches],
                {k: JaxTensor(v) for k, v in inputs.items()},
                shape,
            )
        return _value(logits), [_value(c) for c in new]

    def _traced_copy(self, caches: list[Any], src: Any, dst: Any) -> list[Any]:
        self.compilations += 1
        return _copy_blocks(caches, src, dst)

    def _inputs(self, inputs: StepInputs) -> dict[str, Any]:
        return {k: jax.device_put(to_jax(v), self._inputs_at) for k, v in inputs.tensors().items()}

    def collectives(self, inputs: StepInputs) -> dict[str, int]:
        """The collectives XLA put in the step compiled for ``inputs``' shape, by kind (all zero on
        one device; with a mesh, what the partitioner inserted)."""
        lowered = self._step.lower(self._weights, self._caches, self._inputs(inputs), inputs.shape)
        return collectives(lowered.compile().as_text() or "")

    def run(self, inputs: StepInputs) -> torch.Tensor:
        before = self.compilations
        t0 = time.monotonic()
        logits, self._caches = self._step(self._weights, self._caches, self._inputs(inputs), inputs.shape)
        if self.compilations != before:
            logits.block_until_ready()
            self.compile_seconds += time.monotonic() - t0
        return _host(logits)

    def warmup(
        self, shapes: Sequence[StepShape], progress: Callable[[int, int, StepShape], None] | None = None
    ) -> None:
        """One all-padding step per shape (writes nothing), then one block copy per copy bucket."""
        super().warmup(shapes, progress)
        for n in COPY_BUCKETS:
            self._run_copy([(0, 0)] * n)

    def _run_copy(self, pairs: list[tuple[int, int]]) -> None:
        bucket = next((b for b in COPY_BUCKETS if b >= len(pairs)), None)
        if bucket is None:  # more than the largest bucket: in pieces
            for i in range(0, len(pairs), COPY_BUCKETS[-1]):
                self._run_copy(pairs[i : i + COPY_BUCKETS[-1]])
            return
        padded = pairs + [(0, 0)] * (bucket - len(pairs))  # block 0 onto itself: the null block, a no-op
        src = jnp.array([s for s, _ in padded], dtype=jnp.int32)
        dst = jnp.array([d for _, d in padded], dtype=jnp.int32)
        self._caches = self._copy(self._caches, src, dst)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._run_copy(pairs)

    def kv_caches(self) -> list[torch.Tensor]:
        return [_host(c).clone() for c in self._caches]


def _host(a: Any) -> torch.Tensor:
    """A device array as a host torch tensor (over the buffer itself when it is already on the host)."""
    if a.devices() != {jax.devices("cpu")[0]}:
        a = jax.device_put(a, jax.devices("cpu")[0])
    return to_torch(a)


def _value(t: Any) -> Any:
    if not isinstance(t, JaxTensor):
        raise TypeError(f"tpu: the step program returned {type(t).__name__}, not a traced tensor")
    return t.value
