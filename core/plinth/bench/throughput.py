"""``plinth bench throughput``: offline throughput on a fixed workload, EOS ignored."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from plinth.bench import output_path
from plinth.bench.datasets import BenchRequest, sharegpt, synthetic, with_fresh_ids
from plinth.engine_args import add_engine_arguments, add_kv_cache_prefault_argument, engine_options, positive_int


def add_bench_throughput_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``plinth bench throughput``."""
    add_engine_arguments(p)
    p.add_argument("--num-prompts", type=positive_int, default=64, help="requests in the workload")
    p.add_argument("--dataset", default=None, help="ShareGPT-format JSON (default: synthetic, seed 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")
    p.add_argument(
        "--passes",
        type=positive_int,
        default=1,
        help="run the workload N times in the same engine (passes after the first: the same lengths, fresh "
        "prompt ids, so the prefix cache saves none of their work); the top-level figures are the first pass's",
    )
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences in one step at most")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=1024, help="token budget of one step")
    add_kv_cache_prefault_argument(p)
    p.add_argument("--json", type=output_path, default=None, help="write the results to this JSON file (default: none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_throughput(llm: Any, requests: list[BenchRequest], progress: bool = True) -> dict[str, Any]:
    """Run every request to exactly its output length; return throughput and KV-cache waste figures."""
    from plinth.sampling_params import SamplingParams

    engine = llm.engine
    sched = engine.scheduler
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req")
    sync = engine.backend.device_services().synchronize
    sync()  # nothing queued from the warm-up or the load may be billed to the run
    start = time.perf_counter()
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(f"bench-{i}", r.prompt_ids, params)
    output_tokens = 0
    slots_sum = stored_sum = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                output_tokens += sum(len(c.token_ids) for c in out.outputs)
                if bar is not None:
                    bar.update(1)
        # KV waste: slots held by running requests minus the tokens stored in them
        slots, stored = sched.kv_slots()
        slots_sum += slots
        stored_sum += stored
    sync()  # the clock stops when the device is done, not when its last work was queued
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    prompt_tokens = sum(len(r.prompt_ids) for r in requests)
    return {
        "backend": engine.backend.name,
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(output_tokens / elapsed, 2),
        "total_tok_s": round((prompt_tokens + output_tokens) / elapsed, 2),
        "kv_waste_pct": round(100.0 * (slots_sum - stored_sum) / slots_sum, 2) if slots_sum else 0.0,
        "preemptions": sched.num_preemptions_total,
        "kv_cache_prefault": engine.config.kv_cache_prefault,
        # ops that ran on the reference kernel: figures measured with any are not the backend's
        "kernel_fallbacks": list(engine.kernels.fallbacks),
    }


def pass_workloads(requests: list[BenchRequest], passes: int, vocab_size: int, seed: int) -> list[list[BenchRequest]]:
    """``passes`` workloads of the same work: ``requests``, then for pass k >= 2 the same lengths with
    prompt ids drawn from the seed ``"{seed}/pass{k}"`` (:func:`~plinth.bench.datasets.with_fresh_ids`)."""
    return [requests] + [with_fresh_ids(requests, vocab_size, f"{seed}/pass{k}") for k in range(2, passes + 1)]


def run_passes(llm: Any, workloads: list[list[BenchRequest]], progress: bool = True) -> dict[str, Any]:
    """:func:`run_throughput` on each workload in turn, in the same engine: the first pass's result,
    with every pass's output tok/s, time and prefix-cache hits (``passes_*``) added. A later pass
    faster than the first by more than the noise is start-up work the first one paid for (warm-up)."""
    sched = llm.engine.scheduler
    results, hits = [], []
    for requests in workloads:
        before = sched.prefix_cache_hit_tokens
        results.append(run_throughput(llm, requests, progress=progress))
        hits.append(sched.prefix_cache_hit_tokens - before)
    return {
        **results[0],
        "passes_output_tok_s": [r["output_tok_s"] for r in results],
        "passes_elapsed_s": [r["elapsed_s"] for r in results],
        "passes_prefix_cache_hit_tokens": hits,
    }


def run_bench_throughput(args: argparse.Namespace) -> int:
    """Entry point of ``plinth bench throughput``."""
    from plinth.llm import LLM

    llm = LLM(**engine_options(args))
    if args.dataset:
        requests = sharegpt(args.dataset, llm.tokenizer, args.num_prompts)
    else:
        requests = synthetic(args.num_prompts, llm.engine.model_config.vocab_size, seed=args.seed)
    workloads = pass_workloads(requests, args.passes, llm.engine.model_config.vocab_size, args.seed)
    result = run_passes(llm, workloads, progress=not args.no_progress)
    if llm.engine.config.num_speculative_tokens:
        from plinth.bench.speculative import spec_summary

        result.update(spec_summary(llm.engine.scheduler))
    print(
        f"{result['requests']} requests, {result['prompt_tokens']} prompt + {result['output_tokens']} output tokens "
        f"in {result['elapsed_s']:.1f} s on {result['backend']}: {result['output_tok_s']:.1f} output tok/s, "
        f"{result['total_tok_s']:.1f} total tok/s, KV waste {result['kv_waste_pct']:.1f}%, "
        f"{result['preemptions']} preemptions"
    )
    if args.passes > 1:
        tok_s = result["passes_output_tok_s"]
        print(
            "  output tok/s by pass: "
            + ", ".join(f"{t:.1f}" for t in tok_s)
            + f" (pass 1 is {100 * tok_s[0] / tok_s[1]:.1f}% of pass 2; prefix-cache hit tokens by pass: "
            f"{result['passes_prefix_cache_hit_tokens']})"
        )
    if "spec_acceptance_rate" in result:
        print(
            f"  speculative decoding: {100 * result['spec_acceptance_rate']:.0f}% of {result['spec_draft_tokens']} "
            f"draft tokens accepted, {result['spec_accepted_tokens_per_step']:.2f} accepted tokens per step with drafts"
        )
    for note in result["kernel_fallbacks"]:
        print(f"  reference fallback: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
