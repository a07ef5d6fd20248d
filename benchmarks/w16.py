"""The cpu backend's 16-bit weight panels (a bf16/fp16 checkpoint kept in an fp32 model) against fp32
panels of the same values, over a model's worth of weights, side by side in one process.

Each row count multiplies activations by every linear weight of a SmolLM2-135M-shaped stack (30
layers of fused qkv, o_proj, gate_up and down: 538 MB as fp32, 269 MB as bf16, so the weights come
from memory as in a decode step, not from cache), once through ``gemm_panels16`` and once through
``gemm_f32_panels``, alternating passes; the fastest pass of each counts. Prints GFLOP/s and the
ratio per row count, with the CPU's AVX-512/AMX flags, the loaded build and the host load.

    python benchmarks/w16.py                      # rows 1 4 16 64 512, 2 threads, bf16
    python benchmarks/w16.py --dtype float16 --threads 1
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from plinth_cpu import native as native_mod

#: (N, K) of SmolLM2-135M's fused qkv, o_proj, gate_up and down projections.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--passes", type=int, default=5, help="passes over the weights per kind and row count")
    args = parser.parse_args()
    nk = native_mod.native()
    if nk is None:
        raise SystemExit(native_mod.native_status())
    nk.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    flags = sorted(f for f in (native_mod._cpu_flags() or set()) if f.startswith(("avx512", "amx")))
    print(f"CPU flags: {', '.join(flags) or 'none (AVX2/FMA only)'}; build {nk.variant.name}; {args.threads} threads; "
          f"{args.dtype} panels; load before {os.getloadavg()[0]:.2f}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    weights16 = [(torch.randn(n, k, generator=gen) * 0.05).to(dtype) for _ in range(LAYERS) for n, k in SHAPES]
    kinds = {
        "16-bit": [(w.shape[0], nk.pack_16(w)) for w in weights16],
        "fp32": [(w.shape[0], nk.pack_f32(w.float())) for w in weights16],
    }
    print("| rows | 16-bit panels GFLOP/s | fp32 panels GFLOP/s | 16-bit / fp32 |")
    print("|---|---|---|---|")
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in SHAPES}}
        flops = sum(2 * m * n * k for n, k in SHAPES) * LAYERS
        best = dict.fromkeys(kinds, float("inf"))
        for _ in range(args.passes):
            for kind, stack in kinds.items():
                gemm = nk.gemm_panels16 if kind == "16-bit" else nk.gemm_f32_panels
                t0 = time.perf_counter()
                for n, panels in stack:
                    gemm(xs[panels.shape[1]], panels, None, n)
                best[kind] = min(best[kind], time.perf_counter() - t0)
        g16, g32 = flops / best["16-bit"] / 1e9, flops / best["fp32"] / 1e9
        print(f"| {m} | {g16:.1f} | {g32:.1f} | {g16 / g32:.2f}x |")
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
