"""Whole steps as HPU graphs (API 1.5/1.6): one capture per step shape, replayed from then on.

The core hands over its step as a pure function of (weights, KV caches, padded inputs)
(:class:`~plinth.platform.backend.StepProgram`). On an HPU each new :class:`StepShape` is captured
once into an HPU graph over static input buffers (habana's ``HPUGraph`` capture/replay, the
counterpart of CUDA graphs), and each later step of that shape copies its inputs into the buffers
and replays. In emulation (no HPU) the same padded program runs eagerly on the CPU and each new
shape is counted as a capture: the check that steady state meets no new shape is the same.

The HPU path has not run in this repository's CI (no Gaudi there); the emulation path has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from plinth.platform.backend import CompiledStep, StepInputs, StepProgram, StepShape
from plinth.platform.devices import HOST


@dataclass(slots=True)
class _Graph:
    """One shape's HPU graph: its static inputs, and the logits it writes."""

    graph: Any
    inputs: dict[str, torch.Tensor]
    logits: torch.Tensor


class GaudiCompiledStep(CompiledStep):
    """The step program per :class:`StepShape`: HPU graphs on the device, eager in emulation.

    :param program: the core's step.
    :param kv_caches: the engine's caches (already on ``device``); this object owns them from now on
        and keeps updating them in place (the graphs were captured over these very tensors).
    :param device: where the step runs.
    :param hpu: ``habana_frameworks.torch.hpu`` on the device; None in emulation.
    """

    def __init__(
        self, program: StepProgram, kv_caches: list[torch.Tensor], device: torch.device, hpu: Any | None = None
    ) -> None:
        self.program = program
        self.device = device
        self.hpu = hpu
        self.compilations = 0
        #: the shapes captured, in order
        self.trace_log: list[StepShape] = []
        self._caches = kv_caches
        self._graphs: dict[StepShape, _Graph] = {}
        self._seen: set[StepShape] = set()

    def _eager(self, tensors: dict[str, torch.Tensor], shape: StepShape) -> torch.Tensor:
        with torch.inference_mode():
            logits, caches = self.program(self.program.weights, self._caches, tensors, shape)
        for mine, theirs in zip(self._caches, caches, strict=True):
            if theirs is not mine:  # the contract allows a new cache; keep ours (the graphs' buffers)
                mine.copy_(theirs)
        return logits

    def _capture(self, shape: StepShape, tensors: dict[str, torch.Tensor]) -> _Graph:
        assert self.hpu is not None
        static = {k: v.clone() for k, v in tensors.items()}
        self._eager(static, shape)  # one eager run first: lazy-mode compilation outside the capture
        graph = self.hpu.HPUGraph()
        stream = self.hpu.Stream()
        with self.hpu.stream(stream):
            graph.capture_begin()
            logits = self._eager(static, shape)
            graph.capture_end()
        return _Graph(graph, static, logits)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        shape = inputs.shape
        tensors = {k: v.to(self.device) for k, v in inputs.tensors().items()}
        if shape not in self._seen:
            self._seen.add(shape)
            self.compilations += 1
            self.trace_log.append(shape)
            if self.hpu is not None:
                self._graphs[shape] = self._capture(shape, tensors)
        if self.hpu is None:
            return self._eager(tensors, shape).to(HOST)
        g = self._graphs[shape]
        for name, value in tensors.items():
            g.inputs[name].copy_(value)
        g.graph.replay()
        return g.logits.to(HOST)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        for cache in self._caches:  # [2, num_blocks, ...]: blocks on dim 1
            cache.index_copy_(1, dst, cache.index_select(1, src))

    def kv_caches(self) -> list[torch.Tensor]:
        return [c.to(HOST).clone() for c in self._caches]
