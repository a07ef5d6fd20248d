"""The tpu backend's own graph path, timed on the shapes of ``graph_paths.py``: plinth's torch graph on
JAX arrays through ``plinth_tpu.bridge``, the whole step one ``jax.jit`` (``plinth_tpu.compiled``).

    python plugins/tpu/benchmarks/bridge_step.py [--attention pallas|jnp] [--json OUT]

The same tiny GQA Llama as ``graph_paths.py`` (``plinth_conformance.tiny_models``, block size 16).
``--attention jnp`` swaps the Pallas kernel (run in Pallas' interpreter on the CPU: slow, and not what a
TPU runs) for the plain-jnp ragged attention with the same semantics, so the step times compare with
``graph_paths.py``'s static attention; ``pallas`` times the interpreter. Per shape: the first call (trace +
XLA compile), the median and minimum of 20 steady steps, compilations over 10 steps of new values, and
the largest logit difference from the reference backend's eager forward of the same step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["PLINTH_TPU_INTERPRET"] = "1"

import torch  # noqa: E402
from plinth_tpu import kernels  # noqa: E402
from plinth_tpu.attention_reference import reference_ragged_paged_attention  # noqa: E402
from plinth_tpu.backend import TPU_KV_LAYOUT, TpuBackend  # noqa: E402

from plinth.config import EngineConfig  # noqa: E402
from plinth.hookspecs import hookimpl  # noqa: E402
from plinth.platform.backend import AttentionKernels, AttentionSpec, StepShape, canonical_kv_view  # noqa: E402
from plinth.platform.host import PluginHost  # noqa: E402
from plinth.platform.reference import ReferenceBackend  # noqa: E402
from plinth.runtime.engine import LLMEngine  # noqa: E402
from plinth.runtime.static import ModelStepProgram, pad_inputs  # noqa: E402
from plinth.sched.output import ScheduledChunk  # noqa: E402
from plinth.sched.request import SequenceId  # noqa: E402
from plinth_conformance.tiny_models import save_tiny_model  # noqa: E402

BLOCK_SIZE = 16
MAX_BLOCKS = 8
SHAPES = {"decode1": (1, 1), "decode8": (8, 1), "prefill64": (1, 64)}  # (sequences, new tokens each)


def _jnp_attend(
    q: Any, k: Any, v: Any, cache: Any, slots: Any, tables: Any, lens: Any, starts: Any, dist: Any, **kw: Any
) -> Any:
    kw.pop("interpret", None)
    i32 = [a.astype("int32") for a in (slots, tables, lens, starts, dist)]
    return reference_ragged_paged_attention(q, k, v, cache, *i32, **kw)


class JnpAttention(kernels.TpuAttention):
    """The tpu backend's attention with the plain-jnp kernel in place of the Pallas one."""

    attention_fn = staticmethod(_jnp_attend)


class Backend(TpuBackend):
    """The tpu backend, attention chosen by ``--attention``."""

    name = "tpu-bench"

    def __init__(self, attention: str) -> None:
        super().__init__()
        self.attention = attention

    def attention_kernels(self, spec: AttentionSpec) -> AttentionKernels:
        if self.attention == "jnp":
            self.capabilities().require_attention(self.name, spec)
            return JnpAttention(spec, TPU_KV_LAYOUT, interpret=True)
        return super().attention_kernels(spec)

    def step_buckets(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> Any:
        from plinth.platform.backend import StepBuckets

        return StepBuckets(tokens=(16, 64), seqs=(8,), blocks_per_seq=(MAX_BLOCKS,))


class _Plugin:
    def __init__(self, backend: object) -> None:
        self.backend = backend

    @hookimpl
    def plinth_register_backends(self) -> list[object]:
        return [self.backend]


def _chunks(shape: str, gen: torch.Generator, vocab: int) -> list[ScheduledChunk[Any]]:
    seqs, new = SHAPES[shape]
    free = (torch.randperm(8 * MAX_BLOCKS, generator=gen) + 1).tolist()
    out = []
    for i in range(seqs):
        start = 99 if shape == "decode1" else (int(torch.randint(0, 100, (1,), generator=gen)) if new == 1 else 0)
        blocks = free[i * MAX_BLOCKS : (i + 1) * MAX_BLOCKS]
        ids = torch.randint(3, vocab, (new,), generator=gen).tolist()
        out.append(ScheduledChunk(SequenceId(f"s{i}", 0), ids, start, blocks, ()))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attention", choices=("jnp", "pallas"), default="jnp")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_model("llama", Path(tmp) / "llama")
        config = dict(
            model=str(folder),
            num_kv_blocks=1 + 8 * MAX_BLOCKS + 8,
            block_size=BLOCK_SIZE,
            max_model_len=128,
            max_num_batched_tokens=64,
            max_num_seqs=8,
            compile_cache_dir="",
        )
        t0 = time.monotonic()
        host = PluginHost(plugins=(("bench", _Plugin(Backend(args.attention))), ("ref", _Plugin(ReferenceBackend()))))
        engine = LLMEngine(EngineConfig(backend="tpu-bench", **config), host=host)  # type: ignore[arg-type]
        ref = LLMEngine(EngineConfig(backend="reference", **config), host=host)  # type: ignore[arg-type]
        static = engine.static
        assert static is not None and static.compiled is not None and ref.static is None
        compiled = static.compiled
        print(f"engine start {time.monotonic() - t0:.1f}s (warm-up compiled {compiled.compilations} functions)")
        vocab = engine.model_config.vocab_size
        gen = torch.Generator().manual_seed(0)
        rows = []
        for shape in SHAPES:
            chunks = _chunks(shape, gen, vocab)
            bucket = StepShape(16 if SHAPES[shape][1] == 1 else 64, 8, MAX_BLOCKS)
            inputs = pad_inputs(chunks, bucket, BLOCK_SIZE)
            # the oracle: the reference kernels' eager forward of the same step over the same cache
            spec = engine.model.attention_specs()[0]
            ref_caches = [
                canonical_kv_view(c, TPU_KV_LAYOUT, spec.num_kv_heads, spec.head_size).clone()
                for c in compiled.kv_caches()
            ]
            want, _ = ModelStepProgram(ref.model, BLOCK_SIZE, vocab, engine.model_config.hidden_size).eager(
                ref_caches, inputs
            )
            before = compiled.compilations
            t = time.monotonic()
            logits = compiled.run(inputs)
            first = time.monotonic() - t
            n = len(chunks)
            diff = float((logits[:n] - want[:n]).abs().max())
            times = []
            for step in [pad_inputs(_chunks(shape, gen, vocab), bucket, BLOCK_SIZE) for _ in range(20)]:
                t = time.monotonic()
                compiled.run(step)  # moving the inputs in and the logits out included, padding not
                times.append(time.monotonic() - t)
            steady = compiled.compilations
            for _ in range(10):
                compiled.run(pad_inputs(_chunks(shape, gen, vocab), bucket, BLOCK_SIZE))
            rows.append(
                {
                    "shape": shape,
                    "first_call_s": round(first, 3),
                    "step_ms_median": round(1e3 * statistics.median(times), 2),
                    "step_ms_min": round(1e3 * min(times), 2),
                    "compiles_first": steady - before,
                    "recompiles": compiled.compilations - steady,
                    "max_abs_diff": diff,
                }
            )
            print(json.dumps(rows[-1]))
        if args.json:
            args.json.write_text(json.dumps({"attention": args.attention, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
