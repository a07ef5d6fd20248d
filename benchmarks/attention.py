"""The cpu backend's native prefill attention on its own: causal chunks over a paged cache (pages
shuffled), optionally against another git revision's kernels, side by side in one process.

Each case is G sequences whose last Q positions are the chunk (Q = L: a fresh prompt; Q < L: a chunk
after earlier context), with a model's head shape (default SmolLM2-135M's: 9 query heads, 3 kv heads,
64 wide, pages of 16). The libraries being compared alternate call by call; the fastest of the repeats
counts. Prints GFLOP/s (2 x 2 x D x heads x the visible positions of every query row) with the CPU's
AVX-512/AMX flags, the build and the host load.

    python benchmarks/attention.py                              # 512-token prompts, 2 threads, fp32 cache
    python benchmarks/attention.py --cache-dtype bfloat16 --threads 1 --against HEAD~1
    python benchmarks/attention.py --cases 1x4096x4096 64x200x200 4x1024x1024 8x300x8
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from isa import cpu_flags_line
from w16 import build_revision

from plinth_cpu import native as native_mod
from plinth_cpu.native import NativeKernels


def case(G: int, L: int, Q: int, H: int, Hk: int, D: int, bs: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """G sequences of L positions whose last Q are queried, over shuffled pages of a fresh cache."""
    per = (L + bs - 1) // bs
    blocks = G * per + 1
    cache = torch.randn(2, blocks, Hk, bs, D, generator=gen).to(dtype)
    order = torch.randperm(blocks, generator=gen)[: G * per].to(torch.int32)
    return {
        "q": torch.randn(G * Q, H, D, generator=gen),
        "cache": cache,
        "tables": order.view(G, per).contiguous(),
        "q_start": torch.arange(G, dtype=torch.int64) * Q,
        "q_lens": torch.full((G,), Q, dtype=torch.int32),
        "seq_lens": torch.full((G,), L, dtype=torch.int32),
        "out": torch.empty(G * Q, H, D),
        "flops": 4 * D * H * G * sum(L - Q + 1 + j for j in range(Q)),
    }


def run(nk: NativeKernels, c: dict, scale: float) -> None:
    nk.prefill_attention(c["q"], c["cache"], c["tables"], c["q_start"], c["q_lens"], c["seq_lens"], c["out"],
                         scale, None, None)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["8x512x512"], help="GxLxQ: sequences x positions x queried")
    parser.add_argument("--heads", default="9/3/64", help="query heads/kv heads/head size")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--against", metavar="REF", help="also time the kernels of this git revision")
    args = parser.parse_args()
    nk = native_mod.native()
    if nk is None:
        raise SystemExit(native_mod.native_status())
    libs = {"this tree": nk}
    tmp = tempfile.TemporaryDirectory()
    if args.against:
        libs[args.against] = build_revision(args.against, nk.variant, Path(tmp.name))
    for lib in libs.values():
        lib.set_num_threads(args.threads)
    H, Hk, D = (int(x) for x in args.heads.split("/"))
    print(f"CPU flags: {cpu_flags_line()}; build {nk.variant.name}; {args.threads} threads; "
          f"{args.cache_dtype} cache; heads {H}/{Hk}x{D}; load before {os.getloadavg()[0]:.2f}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for spec in args.cases:
        G, L, Q = (int(x) for x in spec.split("x"))
        c = case(G, L, Q, H, Hk, D, args.block_size, getattr(torch, args.cache_dtype), gen)
        best = dict.fromkeys(libs, float("inf"))
        outs = {}
        for name, lib in libs.items():  # warm
            run(lib, c, D**-0.5)
            outs[name] = c["out"].clone()
        for _ in range(args.repeats):
            for name, lib in libs.items():
                t0 = time.perf_counter()
                run(lib, c, D**-0.5)
                best[name] = min(best[name], time.perf_counter() - t0)
        line = f"{spec:>14}: " + ", ".join(f"{n} {c['flops'] / best[n] / 1e9:.1f} GFLOP/s" for n in libs)
        if args.against:
            ref = outs[args.against]
            diff = (outs["this tree"] - ref).abs().max().item()
            line += f"; ratio {best[args.against] / best['this tree']:.2f}x; max |diff| {diff:.2e}"
        print(line)


if __name__ == "__main__":
    main()
