"""A bf16 model's linear products three ways, side by side in one process: the cpu backend's native
row tiles, torch's ``F.linear`` on the ``[N, K]`` weight (oneDNN reordering it on every call), and
oneDNN on a weight reordered once at load into its own blocked layout (``PLINTH_CPU_ONEDNN_PACKED``).

Each row count multiplies bf16 activations by every linear weight of a SmolLM2-135M-shaped stack
(30 layers of fused qkv, o_proj, gate_up and down: 269 MB in bf16, so the weights come from memory as
in a decode step). The three calls alternate pass by pass and the fastest pass of each counts; each is
the whole call a bf16 model makes (the native tiles' widening of ``x`` and rounding of the result
included). Prints GFLOP/s and the pre-packed call's speed-up over each of the others, with the CPU's
AVX-512/AMX flags and the host load. ``--dtype float32`` compares the fp32 panels with oneDNN instead.

    python benchmarks/onednn_packed.py                      # rows 1 2 4 8 16 32 64 128 512, 2 threads
    python benchmarks/onednn_packed.py --rows 4 8 16 --threads 1
    python benchmarks/onednn_packed.py --calls pairs --against HEAD~1 --rows 16 64 256   # kernels.c A/B
    python benchmarks/onednn_packed.py --dtype float32 --against HEAD --rows 8 16 32   # the fp32 panels A/B
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from isa import cpu_flags_line
from w16 import SHAPES, build_revision, weight_stack

from plinth_cpu import native as native_mod
from plinth_cpu.gemm import onednn_pack, onednn_packed_linear

#: The column of the AVX512-BF16 pair-panel kernel (a bf16 model's few-row products where the CPU has it).
PAIRS = "bf16 pairs"
#: ``--calls`` names -> columns
CALLS = {"native": "native", "F.linear": "F.linear", "pre-packed": "oneDNN pre-packed", "pairs": PAIRS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--passes", type=int, default=7, help="passes over the weights per call kind and row count")
    parser.add_argument("--calls", default=",".join(CALLS), help=f"which of {','.join(CALLS)} to time (default all)")
    parser.add_argument(
        "--against",
        metavar="REF",
        help="also time the pair kernel (fp32: the panels) of kernels.c at this git revision",
    )
    args = parser.parse_args()
    chosen = {CALLS[c] for c in args.calls.split(",") if c}
    nk = native_mod.native()
    if nk is None:
        raise SystemExit(native_mod.native_status())
    nk.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"CPU flags: {cpu_flags_line()}; build {nk.variant.name}; {args.threads} threads; "
          f"{args.dtype} weights; load before {os.getloadavg()[0]:.2f}")  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    weights = weight_stack(dtype, gen)
    packed = [onednn_pack(w) for w in weights] if "oneDNN pre-packed" in chosen else []

    def native_call(x: torch.Tensor, i: int) -> torch.Tensor:
        if dtype == torch.float32:
            return nk.gemm_f32_panels(x, panels[i], None, weights[i].shape[0])
        return nk.convert(nk.gemm_rows16(nk.convert(x, torch.float32), weights[i], None), dtype)

    panels = [nk.pack_f32(w) for w in weights] if dtype == torch.float32 and "native" in chosen else []
    calls: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "native": native_call,
        "F.linear": lambda x, i: F.linear(x, weights[i]),
        "oneDNN pre-packed": lambda x, i: onednn_packed_linear(x, packed[i], None),
    }
    mine = PAIRS if dtype == torch.bfloat16 else "native"
    against = f"{mine}, {args.against}"
    if args.against:  # the library of that revision, for whichever kernel `mine` names
        tmp = tempfile.TemporaryDirectory()
        old = build_revision(args.against, nk.variant, Path(tmp.name))
        old.set_num_threads(args.threads)
    if dtype == torch.float32 and args.against and "native" in chosen:
        calls[against] = lambda x, i: old.gemm_f32_panels(x, panels[i], None, weights[i].shape[0])
        chosen.add(against)
    if dtype == torch.bfloat16 and nk.bf16_dot and (PAIRS in chosen or args.against):
        # a bf16 model's weights on a CPU with AVX512-BF16: the dot-product kernel on pair panels
        pair_panels = [nk.pack_bf16_pairs(w) for w in weights]
        calls[PAIRS] = lambda x, i: nk.gemm_bf16_pairs(x, pair_panels[i], None, weights[i].shape[0], dtype)
        chosen.add(PAIRS)
        if args.against:
            calls[against] = lambda x, i: old.gemm_bf16_pairs(x, pair_panels[i], None, weights[i].shape[0], dtype)
            chosen.add(against)
    calls = {name: call for name, call in calls.items() if name in chosen}
    ratios = [
        (a, b, f"{short} / {long_b}")
        for a, b, short, long_b in (
            ("oneDNN pre-packed", "native", "pre-packed", "native"),
            ("oneDNN pre-packed", "F.linear", "pre-packed", "F.linear"),
            (PAIRS, "oneDNN pre-packed", PAIRS, "pre-packed"),
            (mine, against, "this tree", args.against),
        )
        if a in calls and b in calls
    ]
    print("| rows | " + " | ".join(f"{c} GFLOP/s" for c in calls) + "".join(f" | {r}" for *_, r in ratios) + " |")
    print("|---" * (len(calls) + len(ratios) + 1) + "|")
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in {k for _, k in SHAPES}}
        flops = sum(2 * m * w.numel() for w in weights)
        best = dict.fromkeys(calls, float("inf"))
        for _ in range(args.passes):
            for name, call in calls.items():
                t0 = time.perf_counter()
                for i, w in enumerate(weights):
                    call(xs[w.shape[1]], i)
                best[name] = min(best[name], time.perf_counter() - t0)
        g = {name: flops / secs / 1e9 for name, secs in best.items()}
        cells = [f"{g[c]:.1f}" for c in calls] + [f"{g[a] / g[b]:.2f}x" for a, b, _ in ratios]
        print(f"| {m} | " + " | ".join(cells) + " |")
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
