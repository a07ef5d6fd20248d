"""The cpu backend's few-row q4_1 GEMM over a model's worth of weights: 4-row groups (``q4_1x4``, the
layout the backend makes at load under int16 activations) against the GGUF blocks in their own order.

Each row count multiplies int16-rounded activations by every linear weight of a SmolLM2-135M-shaped
stack (30 layers of fused qkv, o_proj, gate_up and down as random q4_1 blocks: 66 MB, more than this
host's caches hold, as in a decode step); ``--layers 1`` keeps one layer (2.2 MB) in cache, which shows
the kernels' compute alone. The two layouts alternate pass by pass; the fastest pass of each counts.
Both sides include the call's Python overhead (a decode step's graph replay has none). Prints GB/s of
q4_1 blocks read and the ratio, with the CPU's AVX-512/AMX flags, the build and the host load.

    python benchmarks/q4_1x4.py                       # rows 1 2 4 8 16, 2 threads
    python benchmarks/q4_1x4.py --layers 1 --threads 1
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from isa import cpu_flags_line

from plinth_conformance.quantized import random_weight
from plinth_cpu import native as native_mod
from plinth_cpu.gemm import NATIVE_QUANT_MAX_ROWS

#: (N, K) of SmolLM2-135M's fused qkv, o_proj, gate_up and down projections.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--passes", type=int, default=9, help="passes over the weights per layout and row count")
    args = parser.parse_args()
    if max(args.rows) > NATIVE_QUANT_MAX_ROWS:
        raise SystemExit(f"the few-row kernel serves up to {NATIVE_QUANT_MAX_ROWS} rows")
    nk = native_mod.native()
    if nk is None:
        raise SystemExit(native_mod.native_status())
    nk.set_num_threads(args.threads)
    print(f"CPU flags: {cpu_flags_line()}; build {nk.variant.name}; {args.threads} threads; "
          f"{args.layers} layers; load before {os.getloadavg()[0]:.2f}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    gguf = [(n, k, random_weight("q4_1", n, k, gen).blocks) for _ in range(args.layers) for n, k in SHAPES]
    stacks = {"GGUF order": [("q4_1", n, k, b) for n, k, b in gguf],
              "q4_1x4": [("q4_1x4", n, k, nk.pack_q4_1x4(b, n, k)) for n, k, b in gguf]}  # fmt: skip
    nbytes = sum(b.numel() * b.element_size() for _, _, b in gguf)
    print(f"| rows | {' | '.join(f'{s} GB/s' for s in stacks)} | q4_1x4 / GGUF order |")
    print("|---" * (len(stacks) + 2) + "|")
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in SHAPES}}
        best = dict.fromkeys(stacks, float("inf"))
        for _ in range(args.passes):
            for name, stack in stacks.items():
                t0 = time.perf_counter()
                for fmt, n, k, blocks in stack:
                    nk.gemm_quant(fmt, xs[k], blocks, None, n, "int16")
                best[name] = min(best[name], time.perf_counter() - t0)
        rate = {name: nbytes / secs / 1e9 for name, secs in best.items()}
        cells = [f"{rate[s]:.1f}" for s in stacks] + [f"{rate['q4_1x4'] / rate['GGUF order']:.2f}x"]
        print(f"| {m} | " + " | ".join(cells) + " |")
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
