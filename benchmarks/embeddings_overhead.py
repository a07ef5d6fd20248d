"""The per-step cost of generation A/B, where Python overhead dominates: a tiny random Llama, 1 thread.

    python benchmarks/embeddings_overhead.py A_CHECKOUT B_CHECKOUT TINY_MODEL_FOLDER [ROUNDS]

(a tiny folder: ``save_tiny_folder("llama", path)`` from tests/core/runtime/engine/engine_helpers.py).
Alternating processes (A B B A ...), each timing its own thread's CPU seconds (less sensitive than wall
time to other work on a shared machine), best of 3: 64 requests x 128 greedy tokens, 1 request x 128,
and the scheduler alone (us per decode step of 64 requests, best of 5 x 300 steps). Prints the medians
and the ratio of the best runs.
"""

import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, random, time
from plinth import LLM, SamplingParams
from plinth.sched.request import Request, StopCriteria
from plinth.sched.scheduler import Scheduler
llm = LLM(model=TINY, backend="cpu", dtype="float32", num_threads=1, num_kv_blocks=1200, block_size=16)
rng = random.Random(0)
prompts = [[rng.randrange(1000, 20000) for _ in range(32)] for _ in range(64)]
gen = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
out = {}
best = 1e9
for _ in range(3):
    c = time.thread_time(); llm.generate(prompts, gen); best = min(best, time.thread_time() - c)
out["tiny_64x128_cpu_s"] = best
best = 1e9
for _ in range(3):
    c = time.thread_time(); llm.generate(prompts[0], gen); best = min(best, time.thread_time() - c)
out["tiny_1x128_cpu_s"] = best
best = 1e9
for _ in range(5):
    s = Scheduler(num_blocks=8192, block_size=16, max_num_batched_tokens=4096, max_num_seqs=64, max_model_len=4096)
    for i in range(64):
        s.add_request(Request(f"r{i}", list(range(i * 100, i * 100 + 32)), StopCriteria(max_tokens=4000), params=None))
    o = s.schedule(); s.update(o, {x.seq_id: 5 for x in o.scheduled if x.samples})
    c = time.thread_time()
    for _ in range(300):
        o = s.schedule(); s.update(o, {x.seq_id: 5 for x in o.scheduled})
    best = min(best, (time.thread_time() - c) / 300 * 1e6)
out["sched_step_us"] = best
print(json.dumps(out))
"""
sides = {"A": os.path.join(sys.argv[1], "core"), "B": os.path.join(sys.argv[2], "core")}
WORKER = WORKER.replace("TINY", repr(sys.argv[3]))
res: dict[str, dict[str, list[float]]] = {}
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 6
for r in range(rounds):
    for side in "AB" if r % 2 == 0 else "BA":
        p = subprocess.run(
            [sys.executable, "-c", WORKER],
            env={**os.environ, "PYTHONPATH": sides[side]},
            capture_output=True,
            text=True,
        )
        if p.returncode:
            print(p.stderr[-2000:])
            sys.exit(1)
        d = json.loads(p.stdout.strip().splitlines()[-1])
        print(side, os.getloadavg()[0], d, file=sys.stderr, flush=True)
        for k, v in d.items():
            res.setdefault(k, {}).setdefault(side, []).append(v)
for k, d in res.items():
    a, b = statistics.median(d["A"]), statistics.median(d["B"])
    best_a, best_b = min(d["A"]), min(d["B"])
    print(f"| {k} | median A {a:.4g} | B {b:.4g} | B / A {b / a:.3f} | best A {best_a:.4g} | B {best_b:.4g} | "
          f"B / A {best_b / best_a:.3f} |")  # fmt: skip
