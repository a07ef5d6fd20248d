"""The cpu backend's native prefill attention on its own: causal chunks over a paged cache (pages
shuffled), optionally against another git revision's kernels, side by side in one process.

A case with Q = 1 is a decode batch (one query row per sequence, the decode kernel). ``--bf16-queries``
rounds the queries to bf16 values, as a bf16 model's are; with a bf16 cache, ``--amx`` also times the
same library with its AMX tiles turned off (``plinth_amx_bf16(0)``: the fp32 path), alternating.

Each case is G sequences whose last Q positions are the chunk (Q = L: a fresh prompt; Q < L: a chunk
after earlier context), with a model's head shape (default SmolLM2-135M's: 9 query heads, 3 kv heads,
64 wide, pages of 16), over caches in huge pages as the engine allocates them. ``--layers N`` gives each
of N layers its own cache and times a call over all of them: the engine's decode reads a step's caches
from memory (SmolLM2's 30 layers of 64 sequences of ~225 positions are ~330 MB in bf16), where one
layer's alone would stay in the L3. The libraries being compared alternate call by call; the fastest of the repeats
counts. Prints GFLOP/s (2 x 2 x D x heads x the visible positions of every query row) with the CPU's
AVX-512/AMX flags, the build and the host load.

``--processes N`` runs the cases in N fresh processes, one after another (the revision of ``--against``
built once), and reports each library's median GFLOP/s with its range over them, and the median of
the per-process ratios: on a shared host a decode-sized case (calls of ~1 ms) can run 1.6x apart in two
processes of the same code, steady within each (AMD EPYC Zen 4, 2026-12-07: HEAD against HEAD 0.89x in one
process, 1.64x in the next), while a prefill-sized one stays within 1-2%.

    python benchmarks/attention.py                              # 512-token prompts, 2 threads, fp32 cache
    python benchmarks/attention.py --cache-dtype bfloat16 --threads 1 --against HEAD~1
    python benchmarks/attention.py --cases 1x4096x4096 64x200x200 4x1024x1024 8x300x8
    python benchmarks/attention.py --cache-dtype bfloat16 --bf16-queries --amx --cases 64x225x1 8x512x512
    python benchmarks/attention.py --cache-dtype float8_e4m3fn --cases 64x2048x1   # decode from memory
    python benchmarks/attention.py --cases 64x225x1 --against HEAD --processes 8   # a decode change, judged
    python benchmarks/attention.py --cases 64x225x1 64x2048x1 --layers 30 --cache-dtype bfloat16 --bf16-queries
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from isa import cpu_flags_line
from w16 import build_revision

from plinth_cpu import native as native_mod
from plinth_cpu.host_memory import huge_page_tensor
from plinth_cpu.native import NativeKernels


def case(
    G: int, L: int, Q: int, H: int, Hk: int, D: int, bs: int, dtype: torch.dtype, gen: torch.Generator, layers: int = 1
) -> dict:
    """G sequences of L positions whose last Q are queried, over shuffled pages of fresh caches: one per
    layer, in huge pages as the engine allocates them (``huge_page_tensor``), the same pages in each."""
    per = (L + bs - 1) // bs
    blocks = G * per + 1
    caches = []
    for _ in range(layers):
        cache = huge_page_tensor([2, blocks, Hk, bs, D], dtype)
        cache.copy_(torch.randn(2, blocks, Hk, bs, D, generator=gen))
        caches.append(cache)
    order = torch.randperm(blocks, generator=gen)[: G * per].to(torch.int32)
    return {
        "q": torch.randn(G * Q, H, D, generator=gen),
        "caches": caches,
        "tables": order.view(G, per).contiguous(),
        "q_start": torch.arange(G, dtype=torch.int64) * Q,
        "q_lens": torch.full((G,), Q, dtype=torch.int32),
        "seq_lens": torch.full((G,), L, dtype=torch.int32),
        "out": torch.empty(G * Q, H, D),
        "flops": layers * 4 * D * H * G * sum(L - Q + 1 + j for j in range(Q)),
    }


def run(nk: NativeKernels, c: dict, scale: float) -> None:
    """The case's attention over each layer's cache in turn (the output is the last layer's)."""
    for cache in c["caches"]:
        if int(c["q_lens"].max()) == 1:  # a decode batch
            c["out"].copy_(nk.decode_attention(c["q"], cache, c["tables"], c["seq_lens"], scale, None, None))
            continue
        nk.prefill_attention(c["q"], cache, c["tables"], c["q_start"], c["q_lens"], c["seq_lens"], c["out"],
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


def child_command(args: argparse.Namespace, against_lib: Path | None) -> list[str]:
    """This script with ``args`` for one process of ``--processes`` (its results as JSON lines)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cases", *args.cases, "--heads", args.heads]
    cmd += ["--block-size", str(args.block_size), "--cache-dtype", args.cache_dtype, "--threads", str(args.threads)]
    cmd += ["--layers", str(args.layers), "--repeats", str(args.repeats), "--json-lines"]
    if args.bf16_queries:
        cmd.append("--bf16-queries")
    if args.amx:
        cmd.append("--amx")
    if args.against:
        cmd += ["--against", args.against, "--against-lib", str(against_lib)]
    return cmd


def summarize(results: list[dict], reference: str | None) -> list[str]:
    """Per case, over the processes' ``results`` (one dict per process and case: ``case``, ``gflops``
    by library): each library's median GFLOP/s (min-max), and the median per-process ratio to
    ``reference`` (min-max, how many processes had this tree faster)."""
    lines = []
    for spec in dict.fromkeys(r["case"] for r in results):
        rows = [r for r in results if r["case"] == spec]
        parts = []
        for name in rows[0]["gflops"]:
            g = [r["gflops"][name] for r in rows]
            parts.append(f"{name} {statistics.median(g):.1f} ({min(g):.1f}-{max(g):.1f}) GFLOP/s")
        line = f"{spec:>14}: " + ", ".join(parts)
        if reference:
            ratios = [r["gflops"]["this tree"] / r["gflops"][reference] for r in rows]
            faster = sum(x > 1 for x in ratios)
            line += (f"; ratio median {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}x,"
                     f" this tree faster in {faster} of {len(ratios)})")  # fmt: skip
        diffs = [r["diff"] for r in rows if r.get("diff") is not None]
        if diffs:
            line += f"; max |diff| {max(diffs):.2e}"
        lines.append(line)
    return lines


def over_processes(args: argparse.Namespace, variant: native_mod.IsaVariant) -> None:
    """``--processes N``: the cases in N fresh processes, one after another, summarized."""
    tmp = tempfile.TemporaryDirectory()
    lib = build_revision(args.against, variant, Path(tmp.name)).path if args.against else None
    results: list[dict] = []
    for i in range(args.processes):
        out = subprocess.run(child_command(args, lib), check=True, capture_output=True, text=True).stdout
        if i == 0:
            print(out.splitlines()[0] + f"; {args.processes} processes")
        results += [json.loads(x[len("RESULT ") :]) for x in out.splitlines() if x.startswith("RESULT ")]
    reference = args.against or ("tiles off" if args.amx else None)
    for line in summarize(results, reference):
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["8x512x512"], help="GxLxQ: sequences x positions x queried")
    parser.add_argument("--heads", default="9/3/64", help="query heads/kv heads/head size")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1,
                        help="a cache per layer, each call visiting them all (30: SmolLM2's, whose decode reads "
                        "its caches from memory where one layer's would stay in the L3)")  # fmt: skip
    parser.add_argument("--cache-dtype", choices=["float32", "bfloat16", "float16", "float8_e4m3fn"], default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--against", metavar="REF", help="also time the kernels of this git revision")
    parser.add_argument("--bf16-queries", action="store_true", help="queries rounded to bf16 values (a bf16 model's)")
    parser.add_argument("--amx", action="store_true", help="also time this tree with its AMX tiles off")
    parser.add_argument("--processes", type=int, default=1,
                        help="run the cases in this many fresh processes and report the medians and ranges "
                        "over them (decode-sized cases move between processes)")  # fmt: skip
    parser.add_argument("--against-lib", type=Path, help=argparse.SUPPRESS)  # --against's library, built already
    parser.add_argument("--json-lines", action="store_true", help=argparse.SUPPRESS)  # a --processes child
    args = parser.parse_args()
    if args.processes < 1:
        parser.error(f"--processes must be at least 1, got {args.processes}")
    if args.layers < 1:
        parser.error(f"--layers must be at least 1, got {args.layers}")
    nk = native_mod.native()
    if nk is None:
        raise SystemExit(native_mod.native_status())
    if args.processes > 1:
        over_processes(args, nk.variant)
        return
    libs = {"this tree": nk}
    tmp = tempfile.TemporaryDirectory()
    if args.against:
        libs[args.against] = (
            NativeKernels(args.against_lib, nk.variant)
            if args.against_lib
            else build_revision(args.against, nk.variant, Path(tmp.name))
        )
    if args.amx:
        if not nk.amx_bf16:
            raise SystemExit("--amx: this CPU or build runs no AMX tiles (PLINTH_CPU_AMX, CPUID AMX-BF16)")
        libs["tiles off"] = tiles_off(nk)
    reference = args.against or ("tiles off" if args.amx else None)
    for lib in libs.values():
        lib.set_num_threads(args.threads)
    H, Hk, D = (int(x) for x in args.heads.split("/"))
    print(f"CPU flags: {cpu_flags_line()}; build {nk.variant.name}; {args.threads} threads; "
          f"{args.cache_dtype} cache; heads {H}/{Hk}x{D}; {args.layers} layers; "
          f"load before {os.getloadavg()[0]:.2f}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for spec in args.cases:
        G, L, Q = (int(x) for x in spec.split("x"))
        c = case(G, L, Q, H, Hk, D, args.block_size, getattr(torch, args.cache_dtype), gen, args.layers)
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
        diff = None
        if reference:
            diff = (outs["this tree"] - outs[reference]).abs().max().item()
            line += f"; ratio {best[reference] / best['this tree']:.2f}x; max |diff| {diff:.2e}"
        print(line)
        if args.json_lines:
            gflops = {n: c["flops"] / best[n] / 1e9 for n in libs}
            print("RESULT " + json.dumps({"case": spec, "gflops": gflops, "diff": diff}), flush=True)


if __name__ == "__main__":
    main()
