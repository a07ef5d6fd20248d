"""What a model forward needs besides its weights: the step's batch and the backend's kernels.

The forward context is an argument, never global state: one object per step, built by the runner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from plinth.platform.backend import (
    AttentionKernels,
    AttentionMetadata,
    AttentionSpec,
    GemmKernels,
    LoRABatch,
    MoEKernels,
    MoESpec,
    SmallOps,
)
from plinth.platform.devices import HOST

if TYPE_CHECKING:
    from plinth.parallel.pipeline import PipelineStage
    from plinth.parallel.sharding import TensorParallel


@dataclass(slots=True)
class ForwardContext:
    """One step's varlen batch and the KV caches the attention layers read and write.

    ``lora``: each token's adapter slot, when any token of the step has an adapter (multi-LoRA);
    None otherwise, and then the layers skip LoRA altogether.
    """

    attn: AttentionMetadata  # the varlen batch
    kv_caches: list[torch.Tensor]  # one per layer, made by Backend.allocate_kv_cache
    lora: LoRABatch | None = None


@dataclass(slots=True)
class ModelKernels:
    """The kernels a model is built with, resolved once at load time.

    ``attention`` maps a layer's :class:`AttentionSpec` to its kernels (e.g.
    ``backend.attention_kernels``); it is called once per distinct spec when the model is built.
    ``device`` is where weights and rotary tables are placed. ``quant_formats`` are the block
    formats the GEMM takes natively (weights in other formats are dequantized at load);
    ``quantize`` ("q8_0") quantizes floating-point linear weights at load, None keeps them.
    ``tp`` is this rank's tensor-parallel slice and collectives (None: one process holds the model);
    ``pp`` its pipeline stage (None: every layer here). ``moe`` maps an MoE layer's
    :class:`MoESpec` to its fused-MoE op (None: the reference op); ``moe_quant_formats`` are the
    block formats that op takes its experts in (others are dequantized at load). ``shard_groups``
    (SPMD tensor parallelism, :class:`~plinth.platform.values.SpmdPlan`): the fused q/k/v and
    gate/up rows are loaded as that many contiguous groups, one per shard (1: the plain order).
    """

    gemm: GemmKernels
    ops: SmallOps
    attention: Callable[[AttentionSpec], AttentionKernels]
    device: torch.device = HOST
    quant_formats: frozenset[str] = frozenset()
    quantize: str | None = None
    tp: TensorParallel | None = None
    pp: PipelineStage | None = None
    moe: Callable[[MoESpec], MoEKernels] | None = None
    moe_quant_formats: frozenset[str] = frozenset()
    shard_groups: int = 1
