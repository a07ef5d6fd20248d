"""Decode speed of a tiny MoE model on the cpu backend: the fused-MoE op vs a per-token loop.

A tiny random Qwen3-MoE (64 experts, top-8, hidden 512, expert width 256, 4 layers, the SmolLM2
tokenizer's vocabulary) is saved as a Hugging Face folder and served by ``plinth.LLM`` on the cpu
backend. Each sparse layer's op is then run two ways, side by side in one process:

* **fused**: the backend's ``MoEKernels`` (``plinth_cpu.moe.CpuMoE``): the step's (token, expert)
  pairs sorted by expert, one GEMM pair per expert group, so each expert's weights are read once
  per step;
* **per-token**: the same prepared weights and GEMM kernels, token by token and choice by choice
  (each expert's weights read once per token that chose it), swapped in for the op's ``forward``
  on the loaded model (a measurement device, not a plinth feature).

Decode throughput (output tokens/s over a fixed number of decode steps, prefill excluded) is
measured at 1 and at 64 concurrent sequences, alternating the two variants for ``--rounds`` rounds;
the median of each and the ratio are printed with the host's load.

    python benchmarks/moe_decode.py                 # batch 1 and 64, 2 rounds
    python benchmarks/moe_decode.py --batches 1 16 64 --rounds 3 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

VOCAB = 49152


def save_model(folder: Path, experts: int, top_k: int, hidden: int, width: int, layers: int) -> None:
    """A tiny random Qwen3-MoE with the SmolLM2 tokenizer, as a Hugging Face folder."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from plinth.model.loader import load_tokenizer, resolve_model

    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=hidden // 8,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=width,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    smol = load_tokenizer(resolve_model(None))
    smol.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))


def per_token_forward(op: Any) -> Any:
    """``op.forward`` as ``benchmarks/moe.py``'s per-token loop over the same prepared weights and GEMM."""
    from moe import per_token_loop  # benchmarks/ is on sys.path when this script runs

    return partial(per_token_loop, op)


def decode_tok_s(llm: Any, batch: int, steps: int) -> float:
    """Output tokens/s of ``steps`` decode steps of ``batch`` sequences (prefill timed apart)."""
    from plinth import SamplingParams

    prompts = [[1, 100 + i, 200 + i, 300 + i] for i in range(batch)]
    warm = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, warm)  # prefill + one token
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts, full)
    total = time.perf_counter() - t0
    return batch * steps / max(total - prefill, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    from plinth import LLM
    from plinth.model.layers import SparseMoE

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "moe"
        save_model(folder, args.experts, args.top_k, args.hidden, args.width, args.layers)
        llm = LLM(model=str(folder), backend="cpu", max_model_len=256, num_threads=args.threads)
        blocks = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoE)]
        assert blocks and all(b.op is not None for b in blocks)
        fused = {id(b): b.op.forward for b in blocks}  # type: ignore[union-attr]
        looped = {id(b): per_token_forward(b.op) for b in blocks}
        kind = type(blocks[0].op).__name__
        load = " ".join(f"{v:.1f}" for v in os.getloadavg())
        print(f"host: {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, load average {load} (before)")
        print(
            f"model: Qwen3-MoE, {args.layers} layers, E={args.experts} top-{args.top_k}, hidden {args.hidden}, "
            f"expert width {args.width}, fp32; op {kind}; {args.steps} decode steps per run, {args.rounds} rounds\n"
        )
        print("| sequences | fused tok/s | per-token tok/s | fused / per-token |")
        print("|---|---|---|---|")
        for batch in args.batches:
            results: dict[str, list[float]] = {"fused": [], "per-token": []}
            for _ in range(args.rounds):
                for name, table in (("fused", fused), ("per-token", looped)):
                    for b in blocks:
                        b.op.forward = table[id(b)]  # type: ignore[union-attr,method-assign]
                    results[name].append(decode_tok_s(llm, batch, args.steps))
            f, p = statistics.median(results["fused"]), statistics.median(results["per-token"])
            print(f"| {batch} | {f:.1f} | {p:.1f} | {f / p:.2f} |")
        load = " ".join(f"{v:.1f}" for v in os.getloadavg())
        print(f"\nload average {load} (after)")


if __name__ == "__main__":
    main()
