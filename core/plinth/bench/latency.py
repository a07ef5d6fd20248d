"""``plinth bench latency``: batch-1 decode speed, time to first token, and cold start."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from plinth.config import QUANTIZATION_HELP


def add_bench_latency_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``plinth bench latency``."""
    p.add_argument("--model", default=None)
    p.add_argument("--backend", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quantization", choices=("auto", "none", "int8"), default="auto", help=QUANTIZATION_HELP)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--no-cold-start", action="store_true", help="skip the cold-start measurement")
    p.add_argument("--json", default=None)


def measure_latency(llm: Any, input_len: int, output_len: int, iters: int) -> dict[str, Any]:
    """Median batch-1 decode tok/s and TTFT over ``iters`` runs (after one warm-up run)."""
    import random

    from plinth.sampling_params import SamplingParams

    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    decode, ttft = [], []
    for i in range(iters + 1):
        prompt = [rng.randrange(256, vocab) for _ in range(input_len)]  # fresh: no prefix-cache hit
        [out] = llm.generate(prompt, params)
        if i == 0:
            continue  # warm-up
        decode.append(out.metrics.decode_tokens_per_s)
        ttft.append(out.metrics.time_to_first_token)
    return {
        "backend": llm.engine.backend.name,
        "input_len": input_len,
        "output_len": output_len,
        "decode_tok_s": round(statistics.median(decode), 2),
        "ttft_s": round(statistics.median(ttft), 4),
    }


def measure_cold_start(model: str | None, backend: str | None) -> float:
    """Seconds from starting ``plinth generate --max-tokens 1`` to its exit (process start to first token)."""
    cmd = [sys.executable, "-m", "plinth.cli", "generate", "--max-tokens", "1", "Hi"]
    if model:
        cmd += ["--model", model]
    if backend:
        cmd += ["--backend", backend]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def run_bench_latency(args: argparse.Namespace) -> int:
    """Entry point of ``plinth bench latency``."""
    from plinth.llm import LLM

    llm = LLM(
        model=args.model,
        backend=args.backend,
        dtype=args.dtype,
        num_threads=args.threads,
        quantization=args.quantization,
    )
    result = measure_latency(llm, args.input_len, args.output_len, args.iters)
    if not args.no_cold_start:
        result["cold_start_s"] = round(measure_cold_start(args.model, args.backend), 2)
    line = (
        f"{result['backend']}: batch-1 decode {result['decode_tok_s']:.1f} tok/s "
        f"({args.input_len}-token prompt, {args.output_len} tokens), time to first token {result['ttft_s']:.3f} s"
    )
    if "cold_start_s" in result:
        line += f", cold start to first token {result['cold_start_s']:.2f} s"
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
