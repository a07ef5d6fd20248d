"""The llama.cpp side of ``benchmarks/peers/run.py``; runs in the llama.cpp venv (``setup_llamacpp.sh``).

    .venv-llamacpp/bin/python llamacpp_bench.py info
    .venv-llamacpp/bin/python llamacpp_bench.py throughput --model FILE.gguf --workload FILE.json
    .venv-llamacpp/bin/python llamacpp_bench.py latency --model FILE.gguf --workload FILE.json

The model is the GGUF file plinth loads by default (Q4_1), so both engines read the same quantized
weights; the workload file (written by run.py) holds the exact prompt token ids and output lengths.
llama-cpp-python's ``Llama`` serves one sequence at a time, so ``throughput`` runs the requests one
after another. Results are printed as one line ``PEERS_RESULT {json}`` on stdout. ``latency`` first
generates one token for a short prompt and prints ``PEERS_FIRST_TOKEN <unix time>``: run.py subtracts
the time it started this process to get the start-up time (process start to first token). ``info``
prints the version and ggml's system_info (the instruction sets compiled in) without loading a model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

THREADS = 2
# the ISA features of ggml's system_info worth naming in a row label, widest first
ISA_FEATURES = ("AMX_INT8", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI", "AVX2")


def _emit(tag: str, payload: Any) -> None:
    print(f"{tag} {json.dumps(payload)}", flush=True)


def system_info() -> dict[str, Any]:
    """llama_cpp's version, ggml's system_info line and a short ISA summary of it (e.g.
    ``AVX512 VBMI VNNI BF16, no AMX``)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode().strip()
    # "CPU : SSE3 = 1 | AVX = 1 | ... | AMX_INT8 = 1 | ..." (one "NAME : ..." group per backend)
    flags = {}
    for part in info.replace(":", "|").split("|"):
        name, eq, value = part.partition("=")
        if eq:
            flags[name.strip()] = value.strip()
    on = [f for f in ISA_FEATURES if flags.get(f) == "1"]
    if "AVX512" in on:  # AVX2 and the 256-bit VNNI come with it
        on = [f for f in on if f not in ("AVX2", "AVX_VNNI")]
    isa = " ".join(on).replace(" AVX512_", " ")
    if "AMX_INT8" not in on:
        isa += ", no AMX"
    return {"llama_cpp_version": llama_cpp.__version__, "system_info": info, "isa": isa}


def _llama(args: argparse.Namespace, n_ctx: int) -> Any:
    from llama_cpp import Llama

    return Llama(
        model_path=args.model,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        n_ctx=n_ctx,
        # llama.cpp's own default (flash_attn "auto") turns flash attention on for the CPU backend; the
        # binding's flash_attn=False would turn it off (2-13% slower batch-1 decode in spot checks here)
        flash_attn=True,
        seed=0,
        verbose=False,
    )


def _tokens(llm: Any, prompt_ids: list[int], n: int) -> Iterator[tuple[int, float]]:
    """Exactly ``n`` greedy tokens after ``prompt_ids`` (EOS ignored: ``generate`` never stops by
    itself), each with the ``perf_counter`` time it came out. The generator evaluates a token only
    when asked for the next one, so the last token is sampled but never fed back, as in the other
    engines."""
    gen = llm.generate(prompt_ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
    for i, token in enumerate(gen):
        yield token, time.perf_counter()
        if i + 1 == n:
            break
    gen.close()


def throughput(args: argparse.Namespace, workload: dict[str, Any]) -> dict[str, Any]:
    """The requests one after another, greedy, EOS ignored, each to its output length."""
    reqs = workload["requests"]
    n_ctx = max(args.n_ctx, max(len(r["prompt_ids"]) + r["output_len"] for r in reqs))
    llm = _llama(args, n_ctx)
    start = time.perf_counter()
    output_tokens = 0
    for r in reqs:
        output_tokens += sum(1 for _ in _tokens(llm, r["prompt_ids"], r["output_len"]))
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(r["prompt_ids"]) for r in reqs)
    return {
        "requests": len(reqs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(output_tokens / elapsed, 2),
        "total_tok_s": round((prompt_tokens + output_tokens) / elapsed, 2),
        "n_ctx": n_ctx,
    }


def latency(args: argparse.Namespace, workload: dict[str, Any]) -> dict[str, Any]:
    """Start-up probe, then batch-1 decode tok/s and TTFT: median of the runs after the first (warm-up),
    each on a fresh prompt, measured as plinth does (tokens after the first / first-to-last token time)."""
    llm = _llama(args, args.n_ctx)
    probe = list(_tokens(llm, workload["startup_prompt_ids"], 1))
    print(f"PEERS_FIRST_TOKEN {time.time():.6f}", flush=True)
    assert len(probe) == 1

    output_len = workload["output_len"]
    decode, ttft, e2e = [], [], []
    for i, prompt_ids in enumerate(workload["prompts"]):
        start = time.perf_counter()
        times = [t for _, t in _tokens(llm, prompt_ids, output_len)]
        if i == 0:
            continue  # warm-up
        assert len(times) == output_len
        decode.append((output_len - 1) / (times[-1] - times[0]))
        ttft.append(times[0] - start)
        e2e.append(times[-1] - start)
    return {
        "input_len": len(workload["prompts"][0]),
        "output_len": output_len,
        "decode_tok_s": round(statistics.median(decode), 2),
        "ttft_s": round(statistics.median(ttft), 4),
        "e2e_s": round(statistics.median(e2e), 3),
        "runs_decode_tok_s": [round(d, 2) for d in decode],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["info", "throughput", "latency"])
    p.add_argument("--model", help="GGUF file (plinth's default model)")
    p.add_argument("--workload", help="JSON written by run.py")
    p.add_argument("--n-ctx", type=int, default=2048)
    args = p.parse_args()
    if args.mode == "info":
        _emit("PEERS_RESULT", system_info())
        return
    if not args.model or not args.workload:
        p.error(f"{args.mode} needs --model and --workload")
    with open(args.workload) as f:
        workload = json.load(f)
    _emit("PEERS_INFO", {"llama_threads": THREADS})
    result = throughput(args, workload) if args.mode == "throughput" else latency(args, workload)
    _emit("PEERS_RESULT", {**result, **system_info()})


if __name__ == "__main__":
    main()
