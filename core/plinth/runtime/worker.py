"""A tensor-parallel worker rank's half of the engine: its shard of the model, its KV cache, a runner.

Rank 0 (:class:`plinth.runtime.engine.LLMEngine`) owns the scheduler, the sampler and the tokenizer;
a worker owns only what its forward needs, built by the same :func:`~plinth.runtime.parts.load_parts`
from the same config, so both sides pick the same backend, dtype and block size.
"""

from __future__ import annotations

from plinth.config import EngineConfig
from plinth.parallel.comm import broadcast_object, gather_object
from plinth.parallel.executor import WorkerSetup
from plinth.platform.host import default_host
from plinth.runtime.lora import build_lora
from plinth.runtime.parts import allocate_kv_caches, load_parts, rank_memory
from plinth.runtime.pipeline import PipelineRunner
from plinth.runtime.runner import ModelRunner


def build_worker(config: EngineConfig, rank: int, world_size: int, local_rank: int | None = None) -> ModelRunner:
    """Load rank ``rank``'s shard, take rank 0's KV-cache decision, and return the runner that runs
    each broadcast step (``sample=False``). ``local_rank``: the device its executor reserved for it
    (None: its index among the ranks on its host).

    :raises RuntimeError: rank 0 chose a block size or dtype this rank would not have.
    """
    parts = load_parts(config, default_host(), rank=rank, world_size=world_size, local_rank=local_rank)
    specs = parts.model.attention_specs()
    gather_object(rank_memory(parts, specs))  # rank 0 sizes the cache for the rank with the least room
    setup = broadcast_object(None)
    if not isinstance(setup, WorkerSetup):
        raise RuntimeError(f"rank {rank}: expected the KV-cache setup from rank 0, got {type(setup).__name__}")
    mine = (parts.block_size, parts.dtype, parts.kv_dtype)
    theirs = (setup.block_size, setup.dtype, setup.kv_cache_dtype)
    if mine != theirs:
        raise RuntimeError(f"rank {rank} would run (block size, dtype, kv dtype) {mine}; rank 0 runs {theirs}")
    kv_caches = allocate_kv_caches(parts.backend, specs, setup.num_blocks, prefault=config.kv_cache_prefault)
    attention = parts.kernels.attention(specs[0])
    if parts.stage is not None:
        return PipelineRunner(
            parts.model, kv_caches, attention, parts.services, parts.block_size, parts.stage, sample=False
        )
    runner = ModelRunner(parts.model, kv_caches, attention, parts.services, parts.block_size, sample=False)
    if config.enable_lora:  # slots for this rank's slices; rank 0's decisions fill them (LoRAManager.apply)
        runner.lora = build_lora(
            config, parts.model, parts.kernels.lora, parts.dtype, parts.services.device, parts.model_config
        )
    return runner
