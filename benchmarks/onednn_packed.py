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
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from isa import cpu_flags_line
from w16 import SHAPES, weight_stack

from plinth_cpu import native as native_mod
from plinth_cpu.gemm import onednn_pack, onednn_packed_linear

#: The column of the AVX512-BF16 pair-panel kernel (a bf16 model's few-row products where the CPU has it).
PAIRS = "bf16 pairs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--passes", type=int, default=7, help="passes over the weights per call kind and row count")
    args = parser.parse_args()
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
    packed = [onednn_pack(w) for w in weights]

    def native_call(x: torch.Tensor, i: int) -> torch.Tensor:
        if dtype == torch.float32:
            return nk.gemm_f32_panels(x, panels[i], None, weights[i].shape[0])
        return nk.convert(nk.gemm_rows16(nk.convert(x, torch.float32), weights[i], None), dtype)

    panels = [nk.pack_f32(w) for w in weights] if dtype == torch.float32 else []
    calls: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "native": native_call,
        "F.linear": lambda x, i: F.linear(x, weights[i]),
        "oneDNN pre-packed": lambda x, i: onednn_packed_linear(x, packed[i], None),
    }
    pairs = dtype == torch.bfloat16 and nk.bf16_dot
    if pairs:  # a bf16 model's weights on a CPU with AVX512-BF16: the dot-product kernel on pair panels
        pair_panels = [nk.pack_bf16_pairs(w) for w in weights]
        calls[PAIRS] = lambda x, i: nk.gemm_bf16_pairs(x, pair_panels[i], None, weights[i].shape[0], dtype)
    extra = f" | {PAIRS} / pre-packed" if pairs else ""
    print(
        "| rows | "
        + " | ".join(f"{c} GFLOP/s" for c in calls)
        + f" | pre-packed / native | pre-packed / F.linear{extra} |"
    )
    print("|---" * (len(calls) + 3 + pairs) + "|")
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
        p = g["oneDNN pre-packed"]
        cells = [f"{g[c]:.1f}" for c in calls] + [f"{p / g['native']:.2f}x", f"{p / g['F.linear']:.2f}x"]
        if pairs:
            cells.append(f"{g[PAIRS] / p:.2f}x")
        print(f"| {m} | " + " | ".join(cells) + " |")
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
