"""Embeddings: does a checkout with them generate as fast as one without, and how fast does it embed?

    python benchmarks/embeddings.py --a /path/to/before --b /path/to/after [--rounds 2]

Each side runs in its own process with ``PYTHONPATH=<checkout>/core`` (the same interpreter, so the
same torch), alternating A B B A ... so the drift of a shared machine favours neither; each figure is
the median of its rounds. Each process also reports its CPU seconds (less sensitive than wall time
to other work on a shared machine) and the scheduler's own microseconds per decode step of 64
requests (no model: the part of a step the change touches most).

Per process: the default SmolLM2-135M model, fp32 weights, the cpu backend, 2 threads; a warm-up,
then generation throughput (16 requests of 32 prompt tokens, 64 new tokens each, EOS ignored),
batch-1 decode (64 new tokens), and on a side that has ``LLM.embed`` embedding throughput (64 fresh
inputs of 32 random tokens, last and mean pooling; the default 1024-token step budget, so two steps
of 32 inputs each).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

THREADS = 2

_WORKER = r"""
import json, random, sys, time
from plinth import LLM, SamplingParams
from plinth.sched.request import Request, StopCriteria
from plinth.sched.scheduler import Scheduler

def sched_step_us():
    # the scheduler's own cost per step: 64 running requests decoding, no model (best of 3 x 500 steps)
    best = float("inf")
    for _ in range(3):
        s = Scheduler(num_blocks=8192, block_size=16, max_num_batched_tokens=4096, max_num_seqs=64, max_model_len=4096)
        for i in range(64):
            prompt = list(range(i * 100, i * 100 + 32))
            s.add_request(Request(f"r{i}", prompt, StopCriteria(max_tokens=4000), params=None))
        out = s.schedule(); s.update(out, {x.seq_id: 5 for x in out.scheduled if x.samples})
        t = time.perf_counter()
        for _ in range(500):
            out = s.schedule(); s.update(out, {x.seq_id: 5 for x in out.scheduled})
        best = min(best, (time.perf_counter() - t) / 500 * 1e6)
    return best

llm = LLM(backend="cpu", dtype="float32", quantization="none", num_threads=THREADS, max_model_len=512)
rng = random.Random(0)
prompts = [[rng.randrange(1000, 20000) for _ in range(32)] for _ in range(64)]
gen = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
out = {"sched_step_us": sched_step_us()}
t, c = time.perf_counter(), time.process_time(); llm.generate(prompts[:16], gen)
out["gen_tok_s"] = 16 * 64 / (time.perf_counter() - t); out["gen_cpu_s"] = time.process_time() - c
t, c = time.perf_counter(), time.process_time(); llm.generate(prompts[16], gen)
out["decode_tok_s"] = 64 / (time.perf_counter() - t); out["decode_cpu_s"] = time.process_time() - c
if hasattr(llm, "embed"):
    llm.embed([[rng.randrange(1000, 20000) for _ in range(32)] for _ in range(4)])
    for pooling in ("last", "mean"):  # fresh inputs each time: no prefix-cache hits
        inputs = [[rng.randrange(1000, 20000) for _ in range(32)] for _ in range(64)]
        t = time.perf_counter(); llm.embed(inputs, pooling=pooling)
        out[f"embed_{pooling}_inputs_s"] = 64 / (time.perf_counter() - t)
print(json.dumps(out))
""".replace("THREADS", str(THREADS))


def run_side(checkout: Path) -> dict[str, float]:
    """One process on ``checkout``'s core: its figures."""
    env = {**os.environ, "PYTHONPATH": str(checkout / "core")}
    proc = subprocess.run([sys.executable, "-c", _WORKER], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{checkout} exited {proc.returncode}:\n{proc.stderr[-1500:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", type=Path, required=True, help="the checkout measured as A (before)")
    p.add_argument("--b", type=Path, required=True, help="the checkout measured as B (after)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    args = p.parse_args(argv)
    sides = {"A": args.a.resolve(), "B": args.b.resolve()}
    results: dict[str, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for side in "AB" if r % 2 == 0 else "BA":
            load = os.getloadavg()[0]
            figures = run_side(sides[side])
            print(f"[{time.strftime('%H:%M:%S')}] {side} (load {load:.2f}): {figures}", file=sys.stderr)
            for name, value in figures.items():
                results.setdefault(name, {}).setdefault(side, []).append(value)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")  # fmt: skip
    print(f"A = {sides['A']}, B = {sides['B']}; {cpu}; {THREADS} threads; median of {args.rounds} rounds\n")
    print("| figure | A | B | B / A |\n|---|---|---|---|")
    for name, by_side in results.items():
        b = statistics.median(by_side["B"])
        if "A" in by_side:
            a = statistics.median(by_side["A"])
            print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.3f} |")
        else:
            print(f"| {name} | - | {b:.2f} | - |")
    summary: dict[str, Any] = {k: {s: statistics.median(v) for s, v in d.items()} for k, d in results.items()}
    print("\n" + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
