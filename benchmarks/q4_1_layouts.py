"""The cpu backend's int16 q4_1 GEMM in each layout, over a model's worth of weights: GGUF order,
4-row groups (``q4_1x4``) and 16-row panels (``q4_1p16``, the layout the backend makes at load),
side by side in one process.

Each row count multiplies int16-rounded activations by every linear weight of a SmolLM2-135M-shaped
stack (30 layers of fused qkv, o_proj, gate_up and down as random q4_1 blocks: 66 MB, more than this
host's caches hold, as in a decode step); ``--layers 1`` keeps one layer (2.2 MB) in cache, which shows
the kernels' compute alone. The layouts alternate pass by pass; the fastest pass of each counts. Each
layout runs only at the row counts the backend gives it (GGUF order up to ``NATIVE_QUANT_MAX_ROWS``,
4-row groups up to ``Q4_1X4_MAX_ROWS``, 16-row panels up to ``P16_MAX_ROWS``: any on the AVX-512
build); "-" elsewhere. Both sides include the
call's Python overhead (a decode step's graph replay has none). Prints GFLOP/s (2 M N K flops), the
GB/s of weight bytes read at 1 row, the panels' speed over the groups', with the CPU's AVX-512/AMX flags,
the build and the host load.

    python benchmarks/q4_1_layouts.py                  # rows 1 2 4 8 16 64 512, 2 threads
    python benchmarks/q4_1_layouts.py --layers 1 --threads 1 --rows 1 16
    python benchmarks/q4_1_layouts.py --amx-int8 --rows 16 64 512   # the panels on AMX-INT8 tiles too

``--amx-int8`` adds the 16-row panels on AMX-INT8 tiles (``PLINTH_CPU_AMX_INT8=1``, from 16 rows) as a
fourth layout, alternating with the others, and its speed over the VNNI kernel's; it needs a CPU with
AMX-INT8 (or the emulated build, whose timings mean nothing).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from isa import cpu_flags_line

from plinth_conformance.quantized import random_weight
from plinth_cpu import native as native_mod
from plinth_cpu.gemm import native_quant_max_rows

#: (N, K) of SmolLM2-135M's fused qkv, o_proj, gate_up and down projections.
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--passes", type=int, default=7, help="passes over the weights per layout and row count")
    parser.add_argument("--amx-int8", action="store_true", help="also the 16-row panels on AMX-INT8 tiles")
    args = parser.parse_args()
    nk = native_mod.native()
    if nk is None:
        raise SystemExit(native_mod.native_status())
    amx_before = nk.amx_int8
    if args.amx_int8 and not nk.set_amx_int8(True):
        raise SystemExit(f"--amx-int8: the {nk.variant.name} build has no AMX-INT8 tiles on this CPU")
    nk.set_amx_int8(False)
    nk.set_num_threads(args.threads)
    print(f"CPU flags: {cpu_flags_line()}; build {nk.variant.name}; {args.threads} threads; "
          f"{args.layers} layers; load before {os.getloadavg()[0]:.2f}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    gguf = [(n, k, random_weight("q4_1", n, k, gen).blocks) for _ in range(args.layers) for n, k in SHAPES]
    stacks = {"q4_1": [(n, k, b) for n, k, b in gguf],
              "q4_1x4": [(n, k, nk.pack_q4_1x4(b, n, k)) for n, k, b in gguf]}  # fmt: skip
    stacks["q4_1p16"] = [(n, k, nk.pack_q4_1p16(b, n, k)) for n, k, b in gguf]
    if args.amx_int8:
        stacks[AMX] = stacks["q4_1p16"]
    nbytes = {name: sum(b.numel() * b.element_size() for _, _, b in stack) for name, stack in stacks.items()}
    flops = 2 * sum(n * k for n, k, _ in gguf)
    names = list(stacks)
    ratio = "q4_1p16" in stacks
    extra = " q4_1p16 / q4_1x4 |" if ratio else ""
    extra += " AMX-INT8 / VNNI |" if args.amx_int8 else ""
    print(f"| rows | {' | '.join(f'{s} GFLOP/s' for s in names)} |" + extra)
    print("|---" * (len(names) + 1 + ratio + args.amx_int8) + "|")
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in SHAPES}}
        run = [name for name in names if m <= native_quant_max_rows(_layout(name), nk.variant.name)]
        if m < native_mod.AMX_I8_MIN_ROWS and AMX in run:
            run.remove(AMX)
        best = dict.fromkeys(run, float("inf"))
        for _ in range(args.passes if m <= 64 else 2):
            for name in run:
                t0 = time.perf_counter()
                nk.set_amx_int8(name == AMX)
                for n, k, blocks in stacks[name]:
                    nk.gemm_quant(_layout(name), xs[k], blocks, None, n, "int16")
                best[name] = min(best[name], time.perf_counter() - t0)
        cells = []
        for name in names:
            if name not in best:
                cells.append("-")
                continue
            cell = f"{flops * m / best[name] / 1e9:.1f}"
            cells.append(cell + (f" ({nbytes[name] / best[name] / 1e9:.1f} GB/s)" if m == 1 else ""))
        if ratio:
            both = "q4_1x4" in best and "q4_1p16" in best
            cells.append(f"{best['q4_1x4'] / best['q4_1p16']:.2f}x" if both else "-")
        if args.amx_int8:
            cells.append(f"{best['q4_1p16'] / best[AMX]:.2f}x" if AMX in best else "-")
        print(f"| {m} | " + " | ".join(cells) + " |")
    nk.set_amx_int8(amx_before)
    print(f"load after {os.getloadavg()[0]:.2f}")


#: The 16-row panels on AMX-INT8 tiles, as a column of its own.
AMX = "q4_1p16 AMX-INT8"


def _layout(name: str) -> str:
    return "q4_1p16" if name == AMX else name


if __name__ == "__main__":
    main()
