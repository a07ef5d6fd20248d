"""Gather + SDPA against gather + matmul/softmax (plinth_metal.attention) and, where MLX is installed, MLX's SDPA.

Times MetalAttention.forward with each inner function on the same batches (medians of interleaved
runs, so host noise hits both alike) and prints one line per batch. Run on the CPU (emulation) or,
on a Mac, with --device mps:

    python plugins/metal/benchmarks/attention_paths.py [--device mps] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from plinth_metal import attention
from plinth_metal.attention import MetalAttention, matmul_attend, sdpa_attend
from plinth_metal.backend import METAL_KV_LAYOUT
from plinth_metal.mlx_provider import mlx_available, mlx_sdpa

from plinth.platform.backend import AttentionMetadata, AttentionSpec

#: name -> [(q_len, seq_len), ...]: a decode batch, one long prefill, a mixed step.
BATCHES: dict[str, list[tuple[int, int]]] = {
    "decode 16 x 1024": [(1, 1024)] * 16,
    "prefill 1 x 512": [(512, 512)],
    "mixed 8 decodes + 128-chunk @ 640": [(1, 700)] * 8 + [(128, 640)],
}


def build(cases: list[tuple[int, int]], device: torch.device, dtype: torch.dtype) -> tuple:
    spec = AttentionSpec(
        32, 8, 64, 16, dtype=str(dtype).removeprefix("torch."), kv_cache_dtype=str(dtype).removeprefix("torch.")
    )
    blocks = [-(-s // 16) for _, s in cases]
    cache = torch.randn(2, sum(blocks), 16, 8, 64, dtype=dtype, device=device)
    tables, start = [], 0
    for n in blocks:
        tables.append(list(range(start, start + n)))
        start += n
    meta = AttentionMetadata.from_lengths(
        [q for q, _ in cases], [s for _, s in cases], tables, block_size=16, device=device
    )
    query = torch.randn(sum(q for q, _ in cases), 32, 64, dtype=dtype, device=device)
    return MetalAttention(spec, METAL_KV_LAYOUT), query, cache, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.mps.synchronize if device.type == "mps" else (lambda: None)
    paths = {"sdpa": sdpa_attend, "matmul": matmul_attend}
    if mlx_available():  # the MLX provider's attention: the same gather, MLX's SDPA, copies both ways
        paths["mlx"] = mlx_sdpa
    print(
        f"device {device}, {dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads; H=32 Hkv=8 D=64 bs=16"
    )
    for name, cases in BATCHES.items():
        kernels, query, cache, meta = build(cases, device, dtype)
        times: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(args.repeats + 2):
            for p, fn in paths.items():
                attention.sdpa_attend = fn  # type: ignore[assignment]  # the kernel reads it at call time
                sync()
                t0 = time.perf_counter()
                kernels.forward(query, cache, meta, 0.125)
                sync()
                times[p].append(time.perf_counter() - t0)
        attention.sdpa_attend = paths["sdpa"]  # type: ignore[assignment]
        med = {p: statistics.median(t[2:]) * 1e3 for p, t in times.items()}
        print(f"{name:36s} " + "   ".join(f"{p} {ms:7.2f} ms" for p, ms in med.items()))


if __name__ == "__main__":
    main()
