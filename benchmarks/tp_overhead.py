"""What tensor parallelism costs on one host: gloo's all-reduce per call, and a decode step at TP=1
vs TP=2 (the cpu backend's all-reduce on gloo, and through shared memory) side by side, on a random
Llama of SmolLM2-135M's size (30 layers, hidden 512, 8 heads).

A TP=2 decode step makes 2 all-reduces per layer (after o_proj and down_proj), one for the embedding
and one all-gather of the logits: 62 collectives for 30 layers. Prints one markdown table.

    python benchmarks/tp_overhead.py
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from plinth import LLM, SamplingParams
from plinth_conformance.tiny_models import save_tiny_model

SHAPE = dict(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4
)


def _allreduce_rank(rank: int, port: int, sizes: list[int], iters: int, out: dict[int, float]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    torch.set_num_threads(1)
    for rows in sizes:
        t = torch.randn(rows, SHAPE["hidden_size"])
        for _ in range(20):
            dist.all_reduce(t)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        if rank == 0:
            out[rows] = statistics.median(times) * 1e3
    dist.destroy_process_group()


def allreduce_ms(sizes: list[int], iters: int) -> dict[int, float]:
    """Median ms of one fp32 all-reduce of [rows, hidden] between 2 gloo ranks, per row count."""
    from plinth.parallel.executor import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_allreduce_rank, args=(free_port(), sizes, iters, out), nprocs=2, join=True)
        return dict(out)


def decode_ms(folder: Path, tp: int, batch: int, tokens: int, shm: bool = True) -> float:
    """ms per decode step: (time for ``tokens`` new tokens - time for 1) / (tokens - 1); ``shm=False``
    keeps the cpu backend's all-reduce on gloo (``PLINTH_CPU_SHM_ALLREDUCE=0``, inherited by the workers)."""
    os.environ["PLINTH_CPU_SHM_ALLREDUCE"] = "1" if shm else "0"
    llm = LLM(model=str(folder), backend="cpu", tensor_parallel_size=tp, max_model_len=512, num_kv_blocks=256)
    try:
        prompts = [list(range(3 + i, 35 + i)) for i in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        t1 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        t2 = time.perf_counter()
        return ((t2 - t1) - (t1 - t0)) / (tokens - 1) * 1e3
    finally:
        llm.engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"host: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    ar = allreduce_ms([1, 8, 64], 300)
    print("| gloo all-reduce, fp32 [rows, 512], 2 ranks | median ms |")
    print("|---|---|")
    for rows, ms in sorted(ar.items()):
        print(f"| {rows} rows | {ms:.3f} |")
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_model("llama", Path(tmp) / "m", vocab_size=8192, **SHAPE)
        print("\n| decode step (ms), 30 layers | TP=1 | TP=2, gloo | TP=2, shared memory | gloo / shm |")
        print("|---|---|---|---|---|")
        for batch in (1, 8):
            one, gloo, shm = [], [], []
            for _ in range(args.rounds):  # interleaved: the host's load drifts
                one.append(decode_ms(folder, 1, batch, args.tokens))
                gloo.append(decode_ms(folder, 2, batch, args.tokens, shm=False))
                shm.append(decode_ms(folder, 2, batch, args.tokens, shm=True))
            a, b, c = statistics.median(one), statistics.median(gloo), statistics.median(shm)
            print(f"| batch {batch} | {a:.1f} | {b:.1f} | {c:.1f} | {b / c:.2f} |")


if __name__ == "__main__":
    main()
