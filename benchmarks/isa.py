"""The cpu backend's native GEMMs in each ISA build this CPU runs, side by side in one process.

Every build the CPU runs (:func:`plinth_cpu.native.runnable_variants`: AVX-512 and AVX2 on an
AVX-512 host) is loaded at once, and for each (layer shape, row count) the builds' calls alternate,
so a machine that speeds up or slows down favours none. Measured per build: fp32 weights in panels
(``gemm_f32_panels``) and, at few rows, q4_1 / q8_0 blocks with int16 activations (``gemm_quant``);
torch's ``F.linear`` in fp32 and bf16 alongside (what a backend without native kernels runs).

Prints one markdown table: GFLOP/s of the fastest of the repeats (2 M N K flops), and each build's
speed-up over the AVX2 one. The CPU's AVX-512/AMX flags and the host load are printed with it.

    python benchmarks/isa.py                    # SmolLM2-135M's layer shapes, rows 1 4 16 64 512
    python benchmarks/isa.py --rows 1 64 --threads 1
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from plinth_conformance.quantized import random_weight
from plinth_cpu import native as native_mod
from plinth_cpu.native import NativeKernels

#: (name, N, K): SmolLM2-135M's fused qkv, o_proj, gate_up and down projections.
SHAPES: tuple[tuple[str, int, int], ...] = (
    ("qkv", 960, 576),
    ("o_proj", 576, 576),
    ("gate_up", 3072, 576),
    ("down", 576, 1536),
)
#: ``gemm_quant`` (the per-block kernel) serves up to this many rows (``gemm.NATIVE_QUANT_MAX_ROWS``).
QUANT_MAX_ROWS = 16


def fastest(fns: dict[str, Callable[[], object]], budget_s: float) -> dict[str, float]:
    """Seconds per call of each function, the fastest of rounds that alternate them."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    start = time.perf_counter()
    rounds = 0
    while rounds < 5 or time.perf_counter() - start < budget_s:
        for name, fn in fns.items():
            time.sleep(0.002)  # the other build's pool workers spin ~0.1 ms after a call, then sleep
            reps = 1
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if dt < 2e-3:  # short calls: time a batch of them
                reps = max(1, int(2e-3 / max(dt, 1e-7)))
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                dt = time.perf_counter() - t0
            best[name] = min(best[name], dt / reps)
        rounds += 1
    return best


def cpu_flags_line() -> str:
    """The CPU's AVX-512 and AMX flags, as the brief's ``grep`` prints them."""
    flags = native_mod._cpu_flags() or set()
    isa = sorted(f for f in flags if f.startswith(("avx512", "amx")))
    return ", ".join(isa) if isa else "none (AVX2/FMA only)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per (shape, rows) cell")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    compiler, why_not = native_mod.build_check()
    if compiler is None:
        raise SystemExit(f"no native kernels here: {why_not}")
    builds = {v.name: NativeKernels(native_mod.build(compiler, v), v) for v in native_mod.runnable_variants()}
    for kernels in builds.values():
        kernels.set_num_threads(args.threads)
    print(f"CPU flags: {cpu_flags_line()}; builds: {', '.join(builds)}; {args.threads} threads; "
          f"load before {os.getloadavg()[0]:.2f}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    cols = [f"{b} fp32" for b in builds] + ["torch fp32", "torch bf16"]
    cols += [f"{b} {q}" for q in ("q4_1", "q8_0") for b in builds]
    print("| shape | rows | " + " | ".join(cols) + " | speed-up fp32 | speed-up q4_1 |")
    print("|---" * (len(cols) + 4) + "|")
    for name, n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) * 0.05
        wb = w.to(torch.bfloat16)
        panels = {b: lib.pack_f32(w) for b, lib in builds.items()}
        blocks = {q: random_weight(q, n, k, gen).blocks for q in ("q4_1", "q8_0")}
        for m in args.rows:
            x = torch.randn(m, k, generator=gen)
            xb = x.to(torch.bfloat16)
            fns: dict[str, Callable[[], object]] = {}
            for b, lib in builds.items():
                fns[f"{b} fp32"] = partial(lib.gemm_f32_panels, x, panels[b], None, n)
            fns["torch fp32"] = partial(F.linear, x, w)
            fns["torch bf16"] = partial(F.linear, xb, wb)
            if m <= QUANT_MAX_ROWS:
                for q in ("q4_1", "q8_0"):
                    for b, lib in builds.items():
                        fns[f"{b} {q}"] = partial(lib.gemm_quant, q, x, blocks[q], None, n, "int16")
            secs = fastest(fns, args.budget)
            gflops = {c: 2 * m * n * k / secs[c] / 1e9 for c in secs}
            cells = [f"{gflops[c]:.1f}" if c in gflops else "-" for c in cols]
            best = next(iter(builds))
            up32 = secs["avx2 fp32"] / secs[f"{best} fp32"]
            upq = secs["avx2 q4_1"] / secs[f"{best} q4_1"] if m <= QUANT_MAX_ROWS else None
            print(f"| {name} {n}x{k} | {m} | " + " | ".join(cells) + f" | {up32:.2f}x | "
                  + (f"{upq:.2f}x |" if upq else "- |"))  # fmt: skip
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
