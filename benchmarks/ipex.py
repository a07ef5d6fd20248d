"""IPEX's kernels against the cpu backend's own, side by side in one process: the plinth-ipex table.

    PY=$(scripts/ipex-venv.sh) && $PY benchmarks/ipex.py [--threads 2] [--write] [--json OUT]

Runs in the ipex lane's venv (torch 2.8 + intel-extension-for-pytorch 2.8). SmolLM2-135M's shapes
(hidden 576, 9 heads / 3 KV heads x 64, intermediate 1536, vocab 49152), fp32 and bf16:

* GEMM: one decoder layer's four products (QKV 576->960, O 576->576, gate/up 576->3072, down
  1536->576) at M = 1, 8, 64 (decode batches) and 512 (a prefill), and the LM head 576->49152 at
  M = 1 and 8; decode cases cycle through 8 layers' weights (107 MB in fp32), so the weights come from
  memory as in a real step, not from cache. Every IPEX kernel variant (``mkl``, ``onednn``, ``tpp``)
  that packs on this host is measured; the fastest (geometric mean) is the one the table records.
* attention (``write_and_attend``: the KV write and the paged attention, what a layer calls): decode
  batches of 1, 8 and 64 sequences at contexts 128-1024 (block size 16, block ids shuffled), and one
  512-token prefill.

Each figure is the fastest of repeated timed blocks (the machines are shared: the minimum is the
figure least moved by other load); IPEX's and the cpu backend's blocks alternate (A B B A ...) so a
drift in the machine's speed favours neither. ``--write`` stores the result as this host kind's
table in ``plugins/ipex/plinth_ipex/measured.json``, which decides what the provider contributes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from plinth_ipex.attention import IpexAttention
from plinth_ipex.choice import MEASURED_PATH, MIN_SPEEDUP, decide, op_key, speedup_of
from plinth_ipex.gemm import VARIANTS, IpexGemm, cannot_pack
from plinth_ipex.provider import isa_level

from plinth.platform.backend import AttentionMetadata, AttentionSpec, GemmKernels, LinearWeight
from plinth_cpu.backend import CpuBackend, cpu_model

HIDDEN, HEADS, KV_HEADS, HEAD_SIZE, INTERMEDIATE, VOCAB = 576, 9, 3, 64, 1536, 49152
#: one decoder layer's products as (N, K): QKV, O, gate/up, down
LAYER = ((HEADS * HEAD_SIZE + 2 * KV_HEADS * HEAD_SIZE, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN),
         (HIDDEN, INTERMEDIATE))  # fmt: skip
#: distinct layers' weights the decode cases cycle through (more than the last-level cache holds)
WEIGHT_SETS = 8
BLOCK_SIZE = 16
SCALE = HEAD_SIZE**-0.5


def best_of(fn: Callable[[], object], budget_s: float, min_reps: int = 3, max_reps: int = 200) -> list[float]:
    """Run ``fn`` for about ``budget_s`` seconds (``min_reps``..``max_reps`` times); each run's time in us."""
    fn()  # warm: first-touch pages, lazy init
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def side_by_side(ipex_fn: Callable[[], object], cpu_fn: Callable[[], object], budget_s: float) -> dict[str, float]:
    """Both timed in alternating blocks (A B B A); the fastest run of each, and the medians."""
    runs: dict[str, list[float]] = {"ipex": [], "cpu": []}
    for who in ("ipex", "cpu", "cpu", "ipex"):
        runs[who] += best_of(ipex_fn if who == "ipex" else cpu_fn, budget_s / 4)
    return {
        "ipex_us": round(min(runs["ipex"]), 1),
        "cpu_us": round(min(runs["cpu"]), 1),
        "ipex_median_us": round(statistics.median(runs["ipex"]), 1),
        "cpu_median_us": round(statistics.median(runs["cpu"]), 1),
        "runs": len(runs["ipex"]) + len(runs["cpu"]),
    }


def _layer_weights(gen: torch.Generator, shapes: tuple[tuple[int, int], ...], sets: int) -> list[list[torch.Tensor]]:
    return [[torch.randn(n, k, generator=gen) * k**-0.5 for n, k in shapes] for _ in range(sets)]


def gemm_cases(dtype: torch.dtype, variant: str, own: GemmKernels, budget_s: float) -> dict[str, dict[str, float]]:
    """Every GEMM case for one IPEX ``variant`` against the cpu backend's GEMM ``own``."""
    gen = torch.Generator().manual_seed(0)
    mine = IpexGemm(dtype, variant, own)
    cases: dict[str, dict[str, float]] = {}
    plans: list[tuple[str, tuple[tuple[int, int], ...], int, int]] = [
        ("layer-m1", LAYER, 1, WEIGHT_SETS),
        ("layer-m8", LAYER, 8, WEIGHT_SETS),
        ("layer-m64", LAYER, 64, WEIGHT_SETS),
        ("layer-m512", LAYER, 512, 1),  # compute-bound: one set
        ("lm_head-m1", ((VOCAB, HIDDEN),), 1, 1),  # 113 MB in fp32: from memory anyway
        ("lm_head-m8", ((VOCAB, HIDDEN),), 8, 1),
    ]
    for name, shapes, m, sets in plans:
        weights = _layer_weights(gen, shapes, sets)
        ours: list[LinearWeight] = [own.prepare(w.to(dtype), None) for ws in weights for w in ws]
        theirs: list[LinearWeight] = [mine.prepare(w.to(dtype), None) for ws in weights for w in ws]
        xs = {k: torch.randn(m, k, generator=gen).to(dtype) for _, k in shapes}

        def run(kernels: GemmKernels, prepared: list[LinearWeight], xs: dict[int, torch.Tensor] = xs) -> None:
            for p in prepared:
                kernels.linear(xs[p.in_features], p)

        with torch.inference_mode():
            figures = side_by_side(functools.partial(run, mine, theirs), functools.partial(run, own, ours), budget_s)
        for key in ("ipex_us", "cpu_us", "ipex_median_us", "cpu_median_us"):
            figures[key] = round(figures[key] / sets, 1)  # per layer (or per LM head)
        cases[name] = figures
        ratio = figures["cpu_us"] / figures["ipex_us"]
        print(f"  gemm {str(dtype)[6:]:8} {variant:6} {name:11} ipex {figures['ipex_us']:9.1f} us  "
              f"cpu {figures['cpu_us']:9.1f} us  {ratio:5.2f}x", flush=True)  # fmt: skip
    return cases


def attention_batch(
    contexts: list[int], query_lens: list[int], dtype: torch.dtype, gen: torch.Generator, rng: random.Random
) -> tuple[AttentionSpec, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A batch whose sequence ``i`` appends ``query_lens[i]`` tokens to ``contexts[i]`` cached ones."""
    name = str(dtype).removeprefix("torch.")
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype=name, kv_cache_dtype=name)
    seq_lens = [c + q for c, q in zip(contexts, query_lens, strict=True)]
    need = [-(-s // BLOCK_SIZE) for s in seq_lens]
    ids = list(range(1, sum(need) + 1))  # block 0: the null block
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    cache = torch.randn(2, sum(need) + 1, KV_HEADS, BLOCK_SIZE, HEAD_SIZE, generator=gen).to(dtype)  # CPU layout
    meta = AttentionMetadata.from_lengths(query_lens, seq_lens, tables, block_size=BLOCK_SIZE)
    t = sum(query_lens)
    q = torch.randn(t, HEADS, HEAD_SIZE, generator=gen).to(dtype)
    k = torch.randn(t, KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    v = torch.randn(t, KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    return spec, q, k, v, cache, meta


def attention_cases(dtype: torch.dtype, backend: CpuBackend, budget_s: float) -> dict[str, dict[str, float]]:
    """Every attention case: IPEX's paged attention against the cpu backend's, same cache, same batch."""
    gen = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    spread = [128 + (1024 - 128) * i // 63 for i in range(64)]  # 64 contexts from 128 to 1024
    plans = [
        ("decode-b1-ctx128", [128], [1]),
        ("decode-b1-ctx1024", [1024], [1]),
        ("decode-b8-ctx128-1024", spread[::9], [1] * 8),
        ("decode-b64-ctx128-1024", spread, [1] * 64),
        ("prefill-512", [0], [512]),
    ]
    cases: dict[str, dict[str, float]] = {}
    for name, contexts, q_lens in plans:
        spec, q, k, v, cache, meta = attention_batch(contexts, q_lens, dtype, gen, rng)
        own = backend.attention_kernels(spec)
        mine = IpexAttention(spec, backend.capabilities().kv_cache_layout)
        a = mine.write_and_attend(q, k, v, cache, meta, SCALE)[0]
        b = own.write_and_attend(q, k, v, cache, meta, SCALE)[0]
        diff = (a.float() - b.float()).abs().max().item()
        with torch.inference_mode():
            figures = side_by_side(
                lambda: mine.write_and_attend(q, k, v, cache, meta, SCALE),  # noqa: B023
                lambda: own.write_and_attend(q, k, v, cache, meta, SCALE),  # noqa: B023
                budget_s,
            )
        figures["max_abs_diff"] = float(f"{diff:.3g}")
        cases[name] = figures
        print(f"  attention {str(dtype)[6:]:8} {name:24} ipex {figures['ipex_us']:9.1f} us  "
              f"cpu {figures['cpu_us']:9.1f} us  {figures['cpu_us'] / figures['ipex_us']:5.2f}x  "
              f"(outputs differ by {diff:.2g})", flush=True)  # fmt: skip
    return cases


def measure(budget_s: float, dtypes: list[str], ops: list[str]) -> dict[str, Any]:
    """The table of this host kind: every op's entry, with the host and conditions."""
    backend = CpuBackend()
    table: dict[str, Any] = {"ops": {}, "unavailable": {}}
    for name in dtypes:
        dtype = getattr(torch, name)
        if "gemm" in ops:
            own = backend.gemm_kernels(name)
            per_variant: dict[str, dict[str, dict[str, float]]] = {}
            for variant in VARIANTS:
                if variant == "mkl" and dtype != torch.float32:
                    continue
                if (why := cannot_pack(dtype, variant)) is not None:
                    table["unavailable"][f"{op_key('gemm', name)}/{variant}"] = why
                    print(f"  gemm {name} {variant}: unavailable here: {why}", flush=True)
                    continue
                per_variant[variant] = gemm_cases(dtype, variant, own, budget_s)
            if per_variant:
                speeds = {v: speedup_of({"cases": c}) for v, c in per_variant.items()}
                best = max(speeds, key=lambda v: speeds[v])
                table["ops"][op_key("gemm", name)] = {
                    "variant": best,
                    "cases": per_variant[best],
                    "variants": {v: round(s, 3) for v, s in speeds.items()},
                }
        if "attention" in ops:
            table["ops"][op_key("attention", name)] = {
                "variant": "paged",
                "cases": attention_cases(dtype, backend, budget_s),
            }
    return table


def main(argv: list[str] | None = None) -> int:
    """Measure, print the verdicts, and optionally write this host kind's table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch's and the native pool's threads")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per case and kernel pair")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--ops", default="gemm,attention")
    parser.add_argument("--write", action="store_true", help=f"store this host kind's table in {MEASURED_PATH}")
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args(argv)

    import intel_extension_for_pytorch as ipex

    backend = CpuBackend()
    backend.device_services().set_num_threads(args.threads)
    kind = isa_level()
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    print(f"host kind {kind} (IPEX's ISA level); {cpu_model(cpuinfo)}; {args.threads} threads; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    started = time.time()
    table = measure(args.budget, args.dtypes.split(","), args.ops.split(","))
    table["conditions"] = {
        "cpu": cpu_model(cpuinfo),
        "isa_level": kind,
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": args.threads,
        "torch": torch.__version__,
        "ipex": ipex.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "load_average_1min": [round(os.getloadavg()[0], 1)],
        "seconds": round(time.time() - started),
        "figure": "fastest run of alternating timed blocks, per decoder layer / LM head / attention call",
        "rule": f"chosen where the geometric mean over the cases of cpu_us / ipex_us is at least {MIN_SPEEDUP}",
    }
    for key in table["ops"]:
        print(decide(key, table, kind).reason)
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n")
    if args.write:
        data = json.loads(MEASURED_PATH.read_text()) if MEASURED_PATH.is_file() else {"hosts": {}}
        data["benchmark"] = "benchmarks/ipex.py"
        data["hosts"][kind] = table
        MEASURED_PATH.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote the {kind} table to {MEASURED_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
