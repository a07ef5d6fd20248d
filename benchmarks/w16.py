"""The cpu backend's panel GEMMs over a model's worth of weights: 16-bit panels (a bf16/fp16 checkpoint
kept in an fp32 model) against fp32 panels of the same values, and optionally this tree's kernels
against another git revision's, side by side in one process.

Each row count multiplies activations by every linear weight of a SmolLM2-135M-shaped stack (30
layers of fused qkv, o_proj, gate_up and down: 538 MB as fp32, 269 MB as bf16, so the weights come
from memory as in a decode step, not from cache). The calls being compared alternate pass by pass;
the fastest pass of each counts. Prints GFLOP/s and ratios per row count, with the CPU's
AVX-512/AMX flags, the build and the host load.

    python benchmarks/w16.py                      # rows 1 4 16 64 512, 2 threads, bf16
    python benchmarks/w16.py --dtype float16 --threads 1
    python benchmarks/w16.py --against HEAD~3 --rows 1 4 8 16 64   # kernels.c at HEAD~3 vs this tree
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from isa import cpu_flags_line

from plinth_cpu import native as native_mod
from plinth_cpu.native import NativeKernels

#: (N, K) of SmolLM2-135M's fused qkv, o_proj, gate_up and down projections.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def weight_stack(dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """Every linear weight of the :data:`LAYERS`-layer stack of :data:`SHAPES`, random ``N(0, 0.05^2)``
    values in ``dtype``, layer by layer."""
    return [(torch.randn(n, k, generator=gen) * 0.05).to(dtype) for _ in range(LAYERS) for n, k in SHAPES]


def build_revision(ref: str, variant: native_mod.IsaVariant, out: Path) -> NativeKernels:
    """The library built from ``kernels.c`` and ``abi.h`` as they are at git revision ``ref``."""
    compiler = native_mod.build_check()[0]
    if compiler is None:
        raise SystemExit("no compiler for the native kernels")
    root = Path(__file__).resolve().parents[1]
    for path in (native_mod.SOURCE, native_mod.HEADER):
        rel = path.relative_to(root)
        text = subprocess.run(["git", "show", f"{ref}:{rel}"], cwd=root, check=True, capture_output=True).stdout
        (out / path.name).write_bytes(text)
    lib = out / f"lib-{variant.name}.so"
    cmd = [compiler, *native_mod.FLAGS, *variant.flags, str(out / "kernels.c"), "-o", str(lib), "-lm"]
    subprocess.run(cmd, check=True)
    return NativeKernels(lib, variant)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--passes", type=int, default=7, help="passes over the weights per call kind and row count")
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
    dtype = getattr(torch, args.dtype)
    print(f"CPU flags: {cpu_flags_line()}; build {nk.variant.name}; {args.threads} threads; "
          f"{args.dtype} panels; load before {os.getloadavg()[0]:.2f}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    weights16 = weight_stack(dtype, gen)
    stacks = {
        "16-bit": [(w.shape[0], nk.pack_16(w)) for w in weights16],
        "fp32": [(w.shape[0], nk.pack_f32(w.float())) for w in weights16],
    }
    calls: dict[str, tuple[Callable[..., torch.Tensor], list[tuple[int, torch.Tensor]]]] = {}
    for name, lib in libs.items():
        calls[f"16-bit, {name}"] = (lib.gemm_panels16, stacks["16-bit"])
        calls[f"fp32, {name}"] = (lib.gemm_f32_panels, stacks["fp32"])
    print("| rows | " + " | ".join(f"{c} GFLOP/s" for c in calls) + " | 16-bit / fp32 |"
          + (f" this tree / {args.against}, 16-bit | fp32 |" if args.against else ""))  # fmt: skip
    print("|---" * (len(calls) + 2 + (2 if args.against else 0)) + "|")
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in SHAPES}}
        flops = sum(2 * m * n * k for n, k in SHAPES) * LAYERS
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(args.passes):
            for name, (gemm, stack) in calls.items():
                t0 = time.perf_counter()
                for n, panels in stack:
                    gemm(xs[panels.shape[1]], panels, None, n)
                best[name] = min(best[name], time.perf_counter() - t0)
        g = {name: flops / secs / 1e9 for name, secs in best.items()}
        cells = [f"{g[c]:.1f}" for c in calls] + [f"{g['16-bit, this tree'] / g['fp32, this tree']:.2f}x"]
        if args.against:
            cells += [f"{g['16-bit, this tree'] / g[f'16-bit, {args.against}']:.2f}x",
                      f"{g['fp32, this tree'] / g[f'fp32, {args.against}']:.2f}x"]  # fmt: skip
        print(f"| {m} | " + " | ".join(cells) + " |")
    print(f"load after {os.getloadavg()[0]:.2f}")
    tmp.cleanup()


if __name__ == "__main__":
    main()
