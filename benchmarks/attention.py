"""The cpu backend's native prefill attention on its own: causal chunks over a paged cache (pages
shuffled), optionally against another git revision's kernels, side by side in one process.

A case with Q = 1 is a decode batch (one query row per sequence, the decode kernel). ``--bf16-queries``
rounds the queries to bf16 values, as a bf16 model's are; with a bf16 cache, ``--amx`` also times the
same library with its AMX tiles turned off (``plinth_amx_bf16(0)``: the fp32 path), alternating.

Each case is G sequences whose last Q positions are the chunk (Q = L: a fresh prompt; Q < L: a chunk
after earlier context), with a model's head shape (default SmolLM2-135M's: 9 query heads, 3 kv heads,
64 wide, pages of 16). The libraries being compared alternate call by call; the fastest of the repeats
counts. Prints GFLOP/s (2 x 2 x D x heads x the visible positions of every query row) with the CPU's
AVX-512/AMX flags, the build and the host load.

    python benchmarks/attention.py                              # 512-token prompts, 2 threads, fp32 cache
    python benchmarks/attention.py --cache-dtype bfloat16 --threads 1 --against HEAD~1
    python benchmarks/attention.py --cases 1x4096x4096 64x200x200 4x1024x1024 8x300x8
    python benchmarks/attention.py --cache-dtype bfloat16 --bf16-queries --amx --cases 64x225x1 8x512x512
    python benchmarks/attention.py --cache-dtype float8_e4m3fn --cases 64x2048x1   # decode from memory
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
    if int(c["q_lens"].max()) == 1:  # a decode batch
        c["out"].copy_(nk.decode_attention(c["q"], c["cache"], c["tables"], c["seq_lens"], scale, None, None))
        return
    nk.prefill_attention(c["q"], c["cache"], c["tables"], c["q_start"], c["q_lens"], c["seq_lens"], c["out"],
                         scale, None, None)  # fmt: skip


def tiles_off(nk: NativeKernels) -> NativeKernels:
    """``nk`` called with its AMX tiles turned off for the call (the fp32 path)."""

    class Off:
        def __getattr__(self, name: str):  # noqa: ANN204
            fn = getattr(nk, name)
            if not callable(fn):
                return fn

            def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                nk.lib.plinth_amx_bf16(0)
                try:
                    return fn(*args, **kwargs)
                finally:
                    nk.lib.plinth_amx_bf16(1)

            return call

    return Off()  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["8x512x512"], help="GxLxQ: sequences x positions x queried")
    parser.add_argument("--heads", default="9/3/64", help="query heads/kv heads/head size")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-dtype", choices=["float32", "bfloat16", "float16", "float8_e4m3fn"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--against", metavar="REF", help="also time the kernels of this git revision")
    parser.add_argument("--bf16-queries", action="store_true", help="queries rounded to bf16 values (a bf16 model's)")
    parser.add_argument("--amx", action="store_true", help="also time this tree with its AMX tiles off")
    args = parser.parse_args()
    nk = native_mod.native()
    if nk is None:
        raise SystemExit(native_mod.native_status())
    libs = {"this tree": nk}
    tmp = tempfile.TemporaryDirectory()
    if args.against:
        libs[args.against] = build_revision(args.against, nk.variant, Path(tmp.name))
    if args.amx:
        if not nk.amx_bf16:
            raise SystemExit("--amx: this CPU or build runs no AMX tiles (PLINTH_CPU_AMX, CPUID AMX-BF16)")
        libs["tiles off"] = tiles_off(nk)
    reference = args.against or ("tiles off" if args.amx else None)
    for lib in libs.values():
        lib.set_num_threads(args.threads)
    H, Hk, D = (int(x) for x in args.heads.split("/"))
    print(f"CPU flags: {cpu_flags_line()}; build {nk.variant.name}; {args.threads} threads; "
          f"{args.cache_dtype} cache; heads {H}/{Hk}x{D}; load before {os.getloadavg()[0]:.2f}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for spec in args.cases:
        G, L, Q = (int(x) for x in spec.split("x"))
        c = case(G, L, Q, H, Hk, D, args.block_size, getattr(torch, args.cache_dtype), gen)
        if args.bf16_queries:
            c["q"] = c["q"].bfloat16().float()
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
        if reference:
            diff = (outs["this tree"] - outs[reference]).abs().max().item()
            line += f"; ratio {best[reference] / best['this tree']:.2f}x; max |diff| {diff:.2e}"
        print(line)


if __name__ == "__main__":
    main()
