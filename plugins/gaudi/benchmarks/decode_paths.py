"""Decode attention two ways on the CPU (emulation): flat paged attention vs a padded
per-sequence gather (every sequence's block-table row gathered to the longest's width, one batched
masked attention), for a uniform and a skewed length mix.

The flat list reads each sequence's own blocks only; the padded gather reads B x max_blocks blocks,
mostly padding when one sequence is long and the rest short. Prints one markdown table; run it
side by side, as timings on a shared host are only comparable within one run.

    python plugins/gaudi/benchmarks/decode_paths.py --repeats 9
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from plinth_gaudi.attention import flat_decode

from plinth.platform.backend import FlatBlocks

BLOCK = 128
HEADS, KV_HEADS, HEAD = 32, 8, 64


def padded_gather(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """``[B, W * bs]`` keys per sequence (padding rows included), one masked batched attention."""
    b, w = tables.shape
    keys = k.index_select(0, tables.flatten()).view(b, w * BLOCK, KV_HEADS, HEAD)
    values = v.index_select(0, tables.flatten()).view(b, w * BLOCK, KV_HEADS, HEAD)
    valid = torch.arange(w * BLOCK)[None, :] < lens[:, None]
    qg = q.view(b, KV_HEADS, HEADS // KV_HEADS, HEAD)
    scores = torch.einsum("bhgd,bshd->bhgs", qg, keys) / HEAD**0.5
    probs = torch.softmax(scores.masked_fill(~valid[:, None, None, :], float("-inf")), -1)
    return torch.einsum("bhgs,bshd->bhgd", probs, values.masked_fill(~valid[:, :, None, None], 0)).reshape(
        b, HEADS, HEAD
    )


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.manual_seed(0)
    mixes = {
        "64 x 1024 tokens (uniform)": [1024] * 64,
        "1 x 4096 + 63 x 128 (skewed)": [4096] + [128] * 63,
        "8 x 512 (small batch)": [512] * 8,
    }
    host = platform.processor() or platform.machine()
    print(f"host: {host}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}")
    print("| batch | flat paged attention (ms) | padded gather (ms) | padded / flat | blocks read: flat / padded |")
    print("|---|---|---|---|---|")
    for name, lens_list in mixes.items():
        blocks = [-(-n // BLOCK) for n in lens_list]
        total = sum(blocks)
        k = torch.randn(total + 1, BLOCK, KV_HEADS, HEAD)
        v = torch.randn(total + 1, BLOCK, KV_HEADS, HEAD)
        ids = torch.randperm(total) + 1
        tables, at = [], 0
        width = max(blocks)
        for n in blocks:
            tables.append(ids[at : at + n].tolist() + [0] * (width - n))
            at += n
        lens = torch.tensor(lens_list, dtype=torch.int32)
        q = torch.randn(len(lens_list), HEADS, HEAD)
        flat = FlatBlocks.build(lens_list, tables, BLOCK)
        table_t = torch.tensor(tables)
        a = flat_decode(q, k, v, flat, lens, HEAD**-0.5)
        b = padded_gather(q, k, v, table_t, lens.long())
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
        t_flat = _time(functools.partial(flat_decode, q, k, v, flat, lens, HEAD**-0.5), args.repeats)
        t_pad = _time(functools.partial(padded_gather, q, k, v, table_t, lens.long()), args.repeats)
        print(f"| {name} | {t_flat:.2f} | {t_pad:.2f} | {t_pad / t_flat:.2f} | {total} / {len(lens_list) * width} |")


if __name__ == "__main__":
    main()
