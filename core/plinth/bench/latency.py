"""``plinth bench latency``: batch-1 decode speed, time to first token, and cold start."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from plinth.bench import BenchError, output_path
from plinth.bench.roofline import (
    probe_buffer,
    read_bandwidth_probes,
    weight_bytes_per_token,
    weight_stream,
    weight_stream_probes,
)
from plinth.engine_args import add_engine_arguments, engine_options, int_at_least, positive_int


def add_bench_latency_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``plinth bench latency``."""
    add_engine_arguments(p)
    p.add_argument("--input-len", type=positive_int, default=32, help="prompt tokens (random ids)")
    # two tokens at least: decode speed is measured after the first one
    p.add_argument("--output-len", type=int_at_least(2), default=128, help="tokens to generate")
    p.add_argument("--iters", type=positive_int, default=3, help="measured runs (after one warm-up run)")
    p.add_argument("--no-cold-start", action="store_true", help="skip the cold-start measurement")
    p.add_argument("--json", type=output_path, default=None, help="write the results to this JSON file (default: none)")


def measure_latency(llm: Any, input_len: int, output_len: int, iters: int) -> dict[str, Any]:
    """Median batch-1 decode tok/s and TTFT over ``iters`` runs (after one warm-up run), each held to
    two limits measured in the same run.

    The read-bandwidth probes (DRAM: a 256 MB buffer) and the weight stream (the same probes over the
    model's own linear weights in place, whole passes: what a decode step must read, from wherever the
    host's caches keep it) run before the first run and after each one, so each run is held to the
    better of the figures just before and just after it (the machine's load moves between runs);
    ``pct_of_bandwidth_limit`` and ``pct_of_weight_stream`` are the medians of those per-run
    percentages."""
    import random

    from plinth.sampling_params import SamplingParams

    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    weights = weight_bytes_per_token(llm.engine.model)
    backend = llm.engine.backend.name
    services = llm.engine.backend.device_services()
    stream = weight_stream(llm.engine.model, services)
    decode, ttft, probes, streams = [], [], [], []
    buffer = probe_buffer(services)  # one buffer for every probe of the run

    def take_probes() -> None:
        probes.append(read_bandwidth_probes(services, repeats=3, buffer=buffer))
        streams.append(weight_stream_probes(services, stream, repeats=3))  # last: the weights stay cached

    for i in range(iters + 1):
        prompt = [rng.randrange(256, vocab) for _ in range(input_len)]  # fresh: no prefix-cache hit
        if i > 0:
            take_probes()  # just before run k
        [out] = llm.generate(prompt, params)
        if i == 0:
            continue  # warm-up
        decode.append(out.metrics.decode_tokens_per_s)
        ttft.append(out.metrics.time_to_first_token)
    take_probes()
    adjacent = _adjacent_best(probes)
    pct = [100 * d * weights / (gbps * 1e9) for d, gbps in zip(decode, adjacent, strict=True)]
    best = {name: max(p[name] for p in probes) for name in probes[0]}
    stream_adjacent = _adjacent_best(streams)
    stream_pct = [100 * d * weights / (gbps * 1e9) for d, gbps in zip(decode, stream_adjacent, strict=True)]
    stream_best = {name: max(p[name] for p in streams) for name in streams[0]}
    decode_tok_s = statistics.median(decode)
    return {
        "backend": backend,
        "input_len": input_len,
        "output_len": output_len,
        "decode_tok_s": round(decode_tok_s, 2),
        "decode_tok_s_runs": [round(d, 2) for d in decode],
        "ttft_s": round(statistics.median(ttft), 4),
        "weight_mb_per_token": round(weights / 1e6, 1),
        "read_probe_gbps": {k: round(v, 1) for k, v in best.items()},
        "read_probe_gbps_runs": [round(g, 1) for g in adjacent],
        "bandwidth_limit_tok_s": round(max(best.values()) * 1e9 / weights, 1),
        "pct_of_bandwidth_limit": round(statistics.median(pct), 1),
        "weight_stream_gbps": {k: round(v, 1) for k, v in stream_best.items()},
        "weight_stream_gbps_runs": [round(g, 1) for g in stream_adjacent],
        "weight_stream_tok_s": round(max(stream_best.values()) * 1e9 / weights, 1),
        "pct_of_weight_stream": round(statistics.median(stream_pct), 1),
    }


def _adjacent_best(probes: list[dict[str, float]]) -> list[float]:
    """For run k (between probes k and k + 1): the best figure of either."""
    return [max(*probes[k].values(), *probes[k + 1].values()) for k in range(len(probes) - 1)]


#: Phases of a cold start, in order: process start to interpreter ready, imports (torch, the
#: engine), the engine's own start-up phases, then the prompt's prefill up to its first token.
COLD_START_PHASES = ("python", "imports", "backend", "weights", "tokenizer", "kv_cache", "engine_other", "first_token")
_ENGINE_PHASES = ("backend", "weights", "tokenizer", "kv_cache")  # LLMEngine.startup_seconds


def measure_cold_start(model: str | None, backend: str | None) -> dict[str, Any]:
    """Process start to first token of a fresh ``plinth generate --max-tokens 1``, and its phases.

    The child writes wall-clock marks (``--timings-json``); the clock read here just before it is
    started is the zero. Returns ``{"cold_start_s": total, "cold_start_phases_s": {phase: seconds}}``
    with the phases of :data:`COLD_START_PHASES`; the exit (freeing the model) is not counted.
    """
    with tempfile.TemporaryDirectory(prefix="plinth-cold-") as tmp:
        path = os.path.join(tmp, "timings.json")
        cmd = [sys.executable, "-m", "plinth.cli", "generate", "--max-tokens", "1", "--timings-json", path, "Hi"]
        if model:
            cmd += ["--model", model]
        if backend:
            cmd += ["--backend", backend]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-3:]
            raise BenchError(
                f"the cold-start run `{' '.join(cmd)}` failed (status {proc.returncode}): {' / '.join(tail)}"
            )
        with open(path) as f:
            report = json.load(f)
    marks, engine = report["marks"], report["engine_phases"]
    phases = {
        "python": marks["python"] - t0,
        "imports": marks["imports"] - marks["python"],
        **{k: engine[k] for k in _ENGINE_PHASES},
        "engine_other": marks["engine"] - marks["imports"] - sum(engine[k] for k in _ENGINE_PHASES),
        "first_token": marks["first_token"] - marks["engine"],
    }
    return {
        "cold_start_s": round(marks["first_token"] - t0, 3),
        "cold_start_phases_s": {k: round(phases[k], 3) for k in COLD_START_PHASES},
    }


def run_bench_latency(args: argparse.Namespace) -> int:
    """Entry point of ``plinth bench latency``."""
    from plinth.llm import LLM

    llm = LLM(**engine_options(args))
    result = measure_latency(llm, args.input_len, args.output_len, args.iters)
    if not args.no_cold_start:
        result.update(measure_cold_start(args.model, args.backend))
    # ops that ran on the reference kernel: figures measured with any are not the backend's
    result["kernel_fallbacks"] = list(llm.engine.kernels.fallbacks)
    if llm.engine.config.num_speculative_tokens:
        from plinth.bench.speculative import spec_summary

        result.update(spec_summary(llm.engine.scheduler))
    line = (
        f"{result['backend']}: batch-1 decode {result['decode_tok_s']:.1f} tok/s "
        f"({args.input_len}-token prompt, {args.output_len} tokens), time to first token {result['ttft_s']:.3f} s"
    )
    if "cold_start_s" in result:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in result["cold_start_phases_s"].items())
        line += f", cold start to first token {result['cold_start_s']:.2f} s ({phases})"
    probe = max(result["read_probe_gbps"].values())
    line += (
        f"\n  weights read per token {result['weight_mb_per_token']:.0f} MB; read bandwidth up to {probe:.1f} GB/s "
        f"(probes {result['read_probe_gbps']}) -> limit {result['bandwidth_limit_tok_s']:.1f} tok/s; "
        f"decode reaches {result['pct_of_bandwidth_limit']:.0f}% of the limit (median of the runs "
        f"{result['decode_tok_s_runs']} tok/s, each against the probes just before and after it: "
        f"{result['read_probe_gbps_runs']} GB/s)"
        f"\n  streaming the model's own linear weights in place (whole passes, the same probes): up to "
        f"{max(result['weight_stream_gbps'].values()):.1f} GB/s (probes {result['weight_stream_gbps']}) -> limit "
        f"{result['weight_stream_tok_s']:.1f} tok/s; decode reaches {result['pct_of_weight_stream']:.0f}% of it "
        f"(each run against the passes just before and after it: {result['weight_stream_gbps_runs']} GB/s)"
    )
    if "spec_acceptance_rate" in result:
        line += (
            f"\n  speculative decoding: {100 * result['spec_acceptance_rate']:.0f}% of "
            f"{result['spec_draft_tokens']} draft tokens accepted, {result['spec_accepted_tokens_per_step']:.2f} "
            "accepted tokens per step with drafts (random prompts rarely repeat: see `plinth bench speculative`)"
        )
    line += "".join(f"\n  reference fallback: {note}" for note in result["kernel_fallbacks"])
    print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
