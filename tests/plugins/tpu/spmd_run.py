"""Run by test_tpu_spmd.py in a process of its own (JAX's device count is fixed at its start):
one tiny model on one device and over a 2-device mesh, what each generated and how the mesh holds it.

Usage: ``python spmd_run.py FOLDER DEVICES`` with ``XLA_FLAGS`` and ``PLINTH_TPU_INTERPRET=1`` set;
prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import time

from plinth import LLM, SamplingParams
from plinth.platform.backend import StepInputs, StepShape
from plinth_conformance.tiny_models import assert_same_generations, prompts

ENGINE = dict(num_kv_blocks=96, block_size=16, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8)
LOGPROB_TOL = 2e-4  # float32 on both sides, the same tolerance as the single-device tests


def main(folder: str, dtype: str) -> dict[str, object]:
    batch = prompts(0, (1, 9, 17, 40))
    batch.append(batch[3][:32] + batch[1])  # a prefix-cache hit of two full blocks
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    # the mesh first: with too few devices it fails at once, before a single-device engine compiles
    t0 = time.monotonic()
    llm = LLM(model=folder, backend="tpu", dtype=dtype, tensor_parallel_size=2, **ENGINE)
    got = llm.generate(batch, params)
    t1 = time.monotonic()
    want = LLM(model=folder, backend="tpu", dtype=dtype, **ENGINE).generate(batch, params)
    t2 = time.monotonic()
    worst = assert_same_generations(got, want, LOGPROB_TOL if dtype == "float32" else 5e-2)
    engine = llm.engine
    assert engine.static is not None and engine.static.compiled is not None
    step = engine.static.compiled
    qkv = step._weights["layers.0.self_attn.qkv_proj.weight.weight"]  # type: ignore[attr-defined]
    down = step._weights["layers.0.mlp.down_proj.weight.weight"]  # type: ignore[attr-defined]
    norm = step._weights["norm.weight"]  # type: ignore[attr-defined]
    cache = step._caches[0]  # type: ignore[attr-defined]
    shape = StepShape(16, 8, engine.static.buckets.blocks_per_seq[0])
    return {
        "worst": worst,
        "executor": engine.executor is not None,
        "devices": sorted(str(d) for d in cache.sharding.device_set),
        "qkv": [list(qkv.shape), [list(s.data.shape) for s in qkv.addressable_shards]],
        "down": [list(down.shape), [list(s.data.shape) for s in down.addressable_shards]],
        "norm": [list(norm.shape), [list(s.data.shape) for s in norm.addressable_shards]],
        "cache": [list(cache.shape), [list(s.data.shape) for s in cache.addressable_shards]],
        "collectives": step.collectives(StepInputs.dummy(shape)),  # type: ignore[attr-defined]
        "seconds": [t2 - t1, t1 - t0],  # one device, the mesh
        "compilations_after_warmup": engine.static.compilations_after_warmup,
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
