"""The fused-MoE op on the cpu backend: grouped by expert vs a per-token loop vs the reference op.

* grouped: :class:`plinth_cpu.moe.CpuMoE` (one argsort, one GEMM pair per expert group through the
  backend's GEMM: fp32 panels, or q4_1/q8_0 blocks with ``--quant``);
* per-token: the same prepared weights and GEMM kernels, token by token and choice by choice (each
  expert's weights read once per token that chose it: what the grouping saves);
* reference: :class:`plinth.platform.reference.ReferenceMoE` (torch matmuls per expert group, dense fp32).

Prints one markdown table: time per call (the fastest of the repeats, and the median), and the
per-token and reference times as multiples of the grouped one. Host load is printed with it.

    python benchmarks/moe.py                       # T = 1 and 64; E=8/k=2 H=1024 I=1024, E=64/k=8 H=512 I=256
    python benchmarks/moe.py --tokens 1 64 2048 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from plinth.platform.backend import ExpertWeights, LinearWeight, MoESpec, route_experts
from plinth.platform.reference import ReferenceMoE
from plinth_conformance.quantized import random_weight
from plinth_cpu import CpuBackend
from plinth_cpu.moe import CpuMoE

#: (experts, top-k, hidden, intermediate): a Mixtral-like and a Qwen3-MoE-like layer, scaled down.
SHAPES: tuple[tuple[int, int, int, int], ...] = ((8, 2, 1024, 1024), (64, 8, 512, 256))
#: Block formats ``--quant`` takes (random blocks of typical size, as the conformance suite draws them).
QUANT_FORMATS = ("q4_1", "q8_0")


def per_token_loop(moe: CpuMoE, x: torch.Tensor, logits: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
    """The op token by token through the same GEMM (M = 1 per chosen expert)."""
    s = moe.spec
    route_w, ids = route_experts(logits, s.top_k, s.renormalize)
    gate_up: list[LinearWeight] = weights.data["gate_up"]
    down: list[LinearWeight] = weights.data["down"]
    out = torch.zeros(x.shape[0], s.hidden_size)
    for t, (row_w, row_ids) in enumerate(zip(route_w.tolist(), ids.tolist(), strict=True)):
        xt = x[t : t + 1]
        for w, e in zip(row_w, row_ids, strict=True):
            h = moe.gemm.linear(xt, gate_up[e])
            out[t] += w * moe.gemm.linear(moe._activation(h), down[e])[0]
    return out


def timed(fn: Callable[[], torch.Tensor], budget_s: float, max_reps: int) -> tuple[float, float, int]:
    """(fastest, median) seconds per call after one warm-up call, and the number of timed calls."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times), len(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--threads", type=int, default=None, help="torch and native threads (default: torch's)")
    parser.add_argument("--quant", choices=QUANT_FORMATS, default=None, help="experts in a ggml block format")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timed calls per cell")
    parser.add_argument("--skip-loop-above", type=int, default=4096, help="no per-token loop past this many tokens")
    args = parser.parse_args()
    backend = CpuBackend()
    if args.threads:
        backend.device_services().set_num_threads(args.threads)
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"host: {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, load average {load} (before)")
    print(f"experts: {args.quant or 'fp32 dense'}\n")
    cols = ("E", "k", "H", "I", "T", "grouped ms (min / median)", "per-token ms", "reference ms")
    print("| " + " | ".join(cols) + " | per-token / grouped | reference / grouped |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e, k, h, i in SHAPES:
        spec = MoESpec(e, k, h, i, quant_format=args.quant)
        gen = torch.Generator().manual_seed(0)
        gate_up = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
        down = torch.randn(e, h, i, generator=gen) / i**0.5
        moe = backend.moe_kernels(spec)
        assert isinstance(moe, CpuMoE)
        ref = ReferenceMoE(spec)
        if args.quant is None:
            weights, ref_weights = moe.prepare(gate_up, down), ref.prepare(gate_up, down)
        else:
            gu = [random_weight(args.quant, 2 * i, h, gen) for _ in range(e)]
            dn = [random_weight(args.quant, h, i, gen) for _ in range(e)]
            weights, ref_weights = moe.prepare_quantized(gu, dn), ref.prepare_quantized(gu, dn)
        for t in args.tokens:
            x = torch.randn(t, h, generator=gen)
            logits = torch.randn(t, e, generator=gen)
            g_min, g_med, _ = timed(partial(moe.forward, x, logits, weights), args.budget, 50)
            r_min, _, _ = timed(partial(ref.forward, x, logits, ref_weights), args.budget, 50)
            if t <= args.skip_loop_above:
                l_min, _, _ = timed(partial(per_token_loop, moe, x, logits, weights), args.budget, 20)
                loop, ratio = f"{l_min * 1e3:.2f}", f"{l_min / g_min:.1f}x"
            else:
                loop = ratio = "-"
            print(
                f"| {e} | {k} | {h} | {i} | {t} | {g_min * 1e3:.2f} / {g_med * 1e3:.2f} | {loop} | "
                f"{r_min * 1e3:.2f} | {ratio} | {r_min / g_min:.1f}x |",
                flush=True,
            )
    load = " ".join(f"{v:.1f}" for v in os.getloadavg())
    print(f"\nload average {load} (after)")


if __name__ == "__main__":
    main()
