"""What every rank of an engine builds the same way: the backend, its kernels, (its part of) the model.

Rank 0 (:class:`plinth.runtime.engine.LLMEngine`) and each tensor- or pipeline-parallel worker
(:mod:`plinth.runtime.worker`) call :func:`load_parts` with the same config, so they pick the same
backend, dtype and block size; :func:`allocate_kv_caches` gives each its layers' caches.
"""

from __future__ import annotations

import inspect
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from plinth.config import EngineConfig
from plinth.model.config import ModelConfig
from plinth.model.context import ModelKernels
from plinth.model.loader import ModelSource, load_config, load_model, resolve_model
from plinth.parallel.comm import all_gather_object
from plinth.parallel.layout import ParallelLayout, local_ranks
from plinth.parallel.pipeline import PipelineError, PipelineStage, stage_layers
from plinth.parallel.sharding import ShardingError, ShardPlan, TensorParallel
from plinth.parallel.spmd import check_spmd
from plinth.platform.backend import AttentionSpec, Backend, Capabilities, DeviceServices, torch_dtype
from plinth.platform.host import BackendStatus, PluginHost
from plinth.platform.kernels import KernelSet, resolve_kernels

if TYPE_CHECKING:
    from plinth.parallel.executor import RankMemory

_PREFERRED_BLOCK_SIZE = 16
DEFAULT_KV_FRACTION = 0.3  # of a rank's share of free memory, when the user does not size the cache
MAX_DEFAULT_KV_BYTES = 1 << 30


def rank_memory(parts: ModelParts, specs: list[AttentionSpec]) -> RankMemory:
    """This rank's room for the KV cache once its weights are loaded, and what one block costs it."""
    from plinth.parallel.executor import RankMemory, host_identity

    layout = parts.caps.kv_cache_layout  # sized from the physical shape (padding included)
    itemsize = torch_dtype(parts.kv_dtype).itemsize
    block_bytes = sum(layout.block_bytes(parts.block_size, s.num_kv_heads, s.head_size, itemsize) for s in specs)
    free, _total = parts.services.memory_info()
    return RankMemory(host_identity(), str(parts.services.device), free, block_bytes)


def kv_blocks(ranks: list[RankMemory], config: EngineConfig, needed: int) -> int:
    """The KV blocks every rank allocates: as many as the rank with the least room holds, at most
    ``needed`` (``max_num_seqs`` full contexts), or ``config.num_kv_blocks`` when set.

    Each rank's budget is ``config.kv_cache_memory_gb``, or a fraction of its device's free memory
    (capped): ranks on one device (the CPU ranks of one host) share that memory, each counting its
    share; ranks on devices of their own (GPUs, other hosts) each count all of theirs. A pipeline
    stage's block costs its own layers' bytes, so stages of unequal depth hold different counts.

    :param ranks: every rank's :class:`~plinth.parallel.executor.RankMemory`, rank 0 first.
    :raises InvalidRequest: a rank's budget holds fewer than 2 blocks (naming the rank).
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    sharing = Counter((r.host, r.device) for r in ranks)
    held = []
    for rank, r in enumerate(ranks):
        if config.kv_cache_memory_gb is not None:
            budget = int(config.kv_cache_memory_gb * (1 << 30))
        else:
            share = r.free_bytes // sharing[r.host, r.device]
            budget = min(int(share * DEFAULT_KV_FRACTION), MAX_DEFAULT_KV_BYTES)
        if budget // r.block_bytes < 2:
            where = f" on rank {rank}" if len(ranks) > 1 else ""
            raise InvalidRequest(f"KV cache budget of {budget} bytes{where} holds no block of {r.block_bytes} bytes")
        held.append(budget // r.block_bytes)
    return int(min(*held, needed))


def allocate_kv_caches(
    backend: Backend, specs: list[AttentionSpec], num_blocks: int, *, prefault: bool
) -> list[torch.Tensor]:
    """One KV cache per layer from ``backend``; ``prefault`` is passed only to an implementation that
    takes it (API 1.4), as pluggy prunes a hook argument an older implementation does not know."""
    allocate = backend.allocate_kv_cache
    if "prefault" in inspect.signature(allocate).parameters:
        return [allocate(spec, num_blocks, prefault=prefault) for spec in specs]
    caches = [allocate(spec, num_blocks) for spec in specs]
    if prefault:
        for cache in caches:
            cache.zero_()  # what the engine did for every backend before 1.4: every page touched now
    return caches


class InvalidRequest(ValueError):
    """A request the engine refuses (the others keep running). The message names what was wrong;
    ``param``, when set, the request field at fault (a server's 400 names it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class ModelParts:
    """What every rank builds the same way: the backend, its kernels and (its shard of) the model."""

    status: BackendStatus
    backend: Backend
    services: DeviceServices
    caps: Capabilities
    kernels: KernelSet
    model: Any
    model_config: ModelConfig
    source: ModelSource
    dtype: str
    kv_dtype: str
    block_size: int
    seconds: dict[str, float]
    #: this rank's pipeline stage (None without pipeline parallelism)
    stage: PipelineStage | None = None
    #: devices an SPMD backend's mesh splits the model over (1: none; see :mod:`plinth.parallel.spmd`)
    spmd_size: int = 1


def _split(
    config: EngineConfig,
    services: DeviceServices,
    caps: Capabilities,
    backend_name: str,
    model_config: ModelConfig,
    rank: int,
    world_size: int,
    local_rank: int,
) -> tuple[TensorParallel | None, PipelineStage | None]:
    """Rank ``rank``'s tensor-parallel slice and pipeline stage (each None where that size is 1), with
    the communicators they run on: one group of every rank when only one of the two splits, else
    the world split into tensor-parallel groups (one per stage) and pipeline groups (one per
    tensor-parallel rank; see :class:`~plinth.parallel.layout.ParallelLayout`).

    :raises InvalidRequest: the model does not split so, or the backend cannot split the world.
    """
    layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size, rank)
    if layout.world_size != world_size:
        raise ValueError(
            f"a world of {world_size} ranks for a {layout.pipeline_parallel_size} x "
            f"{layout.tensor_parallel_size} layout"
        )
    device = services.device_for_rank(local_rank)
    if device != services.device:
        raise InvalidRequest(
            f"backend {backend_name!r} maps rank {rank} (local rank {local_rank}) to {device}, but its "
            f"services drive {services.device} after bind_local_rank (plugin API 1.13)"
        )
    tp_size, pp_size = layout.tensor_parallel_size, layout.pipeline_parallel_size
    try:
        layers = stage_layers(model_config.num_layers, pp_size, layout.stage) if pp_size > 1 else None
        plan = ShardPlan.for_config(model_config, layout.tp_rank, tp_size) if tp_size > 1 else None
    except (ShardingError, PipelineError) as e:
        raise InvalidRequest(str(e)) from None
    if plan is None or layers is None:  # one split: its group is the whole world
        comm = services.communicator(world_size, rank, caps.communicator)
        tp_comm = pp_comm = comm
    else:
        if "groups" not in inspect.signature(services.communicator).parameters:
            raise InvalidRequest(
                f"backend {backend_name!r}: its DeviceServices.communicator takes no groups (plugin API "
                "1.10), which tensor and pipeline parallelism together need; use one of them"
            )
        tp_comm = services.communicator(world_size, rank, caps.communicator, groups=layout.tp_groups())
        pp_comm = services.communicator(world_size, rank, caps.communicator, groups=layout.pp_groups())
    tp = TensorParallel(plan, tp_comm) if plan is not None else None
    pp = PipelineStage(layout.stage, pp_size, layers, pp_comm, tp_rank=layout.tp_rank) if layers is not None else None
    return tp, pp


def _bind_local_rank(backend: Backend, rank: int, given: int | None) -> int:
    """Every rank's host, gathered (collective: every rank calls it at start-up), gives this rank's
    local rank, unless its executor ``given`` it one (the device Ray reserved for it); the backend
    binds this process to that rank's device (plugin API 1.13).

    :raises InvalidRequest: the backend has no device for it, naming the rank.
    """
    from plinth.parallel.executor import host_identity

    local_rank = local_ranks(all_gather_object(host_identity()))[rank]
    if given is not None:
        local_rank = given
    try:
        backend.bind_local_rank(local_rank)
    except ValueError as e:
        raise InvalidRequest(f"rank {rank} (local rank {local_rank}) on backend {backend.name!r}: {e}") from None
    return local_rank


def uses_spmd(config: EngineConfig, host: PluginHost) -> bool:
    """True when ``config`` asks for tensor parallelism alone on a backend that declares
    ``Capabilities.spmd``: one process drives the mesh, no workers are started."""
    if config.tensor_parallel_size == 1 or config.pipeline_parallel_size > 1:
        return False
    return host.select(config.backend).backend.capabilities().spmd


def load_parts(
    config: EngineConfig,
    host: PluginHost,
    *,
    rank: int = 0,
    world_size: int = 1,
    spmd: bool = False,
    local_rank: int | None = None,
) -> ModelParts:
    """Select the backend, resolve its kernels and load the model: all of it, or with
    ``world_size > 1`` rank ``rank``'s tensor-parallel shard of its pipeline stage (``torch.distributed``
    already joined). ``spmd`` (see :func:`uses_spmd`): all of it, its fused rows grouped for a mesh of
    ``tensor_parallel_size`` devices. ``local_rank``: the device index the executor reserved for
    this rank (Ray); None: its index among the ranks on its host.

    :raises InvalidRequest: a quantization the backend cannot run, or a model that does not split.
    """
    t0 = time.monotonic()
    status = host.select(config.backend)
    backend = status.backend
    local_rank = _bind_local_rank(backend, rank, local_rank) if world_size > 1 else 0
    services = backend.device_services()
    if config.num_threads is not None:  # before any kernels are asked for, so they start with it
        services.set_num_threads(config.num_threads)
    dtype = config.dtype or services.default_dtype()
    kv_dtype = config.kv_cache_dtype or dtype
    caps = backend.capabilities()
    block_size = (
        config.block_size
        or caps.preferred_block_size
        or (_PREFERRED_BLOCK_SIZE if _PREFERRED_BLOCK_SIZE in caps.block_sizes else caps.block_sizes[0])
    )
    kernels = resolve_kernels(backend, host.kernel_providers(backend.name), dtype, config.strict)
    quant_formats = caps.quant_formats if config.quantization != "none" else frozenset()
    if config.quantization == "int8" and "q8_0" not in quant_formats:
        raise InvalidRequest(
            f"quantization 'int8' needs a backend that multiplies q8_0 weights; {backend.name} declares "
            f"{', '.join(sorted(caps.quant_formats)) or 'no quantized formats'}"
        )
    seconds = {"backend": time.monotonic() - t0}
    lap = time.monotonic()
    source = resolve_model(config.model)
    tp = pp = None
    if world_size > 1:
        tp, pp = _split(config, services, caps, backend.name, load_config(source), rank, world_size, local_rank)
    spmd_size = 1
    if spmd:
        spmd_size = config.tensor_parallel_size
        if not caps.spmd:
            raise InvalidRequest(f"backend {backend.name!r} does not drive a device mesh (Capabilities.spmd)")
        try:
            check_spmd(load_config(source), spmd_size)
        except ShardingError as e:
            raise InvalidRequest(str(e)) from None
    # experts stay in their blocks where the fused-MoE op takes the format (and quantization allows)
    moe_formats: frozenset[str] = frozenset()
    if caps.fused_moe is not None and config.quantization != "none":
        moe_formats = caps.fused_moe.quant_formats
    model, model_config = load_model(
        source,
        ModelKernels(
            gemm=kernels.gemm,
            ops=kernels.ops,
            attention=kernels.attention,
            device=services.device,
            quant_formats=quant_formats,
            quantize="q8_0" if config.quantization == "int8" else None,
            tp=tp,
            pp=pp,
            moe=kernels.moe,
            moe_quant_formats=moe_formats,
            shard_groups=spmd_size,
        ),
        dtype=torch_dtype(dtype),
        block_size=block_size,
        kv_cache_dtype=kv_dtype,
        allow_pickle=config.allow_pickle,
    )
    seconds["weights"] = time.monotonic() - lap
    return ModelParts(
        status,
        backend,
        services,
        caps,
        kernels,
        model,
        model_config,
        source,
        dtype,
        kv_dtype,
        block_size,
        seconds,
        pp,
        spmd_size,
    )
