"""Prompt logprobs: what they cost when asked for, and that requests without them pay nothing.

    python benchmarks/prompt_logprobs.py A_CHECKOUT B_CHECKOUT [ROUNDS]
    python benchmarks/prompt_logprobs.py - B_CHECKOUT [ROUNDS]      (B's prompt-logprobs cost only)

The default model (SmolLM2-135M-Instruct, its Q4_1 blocks multiplied natively) on the cpu backend,
2 threads, prefix caching off (every run computes its whole prompt). Alternating processes (A B B A
...) with each checkout's own sources first on PYTHONPATH, each reporting the best of 2 wall-clock
runs of: 8 prompts of 512 tokens (1 greedy token each: prefill), 16 requests x 64 greedy tokens
(32-token prompts: decode), and on B only, one 512-token prompt with ``prompt_logprobs=5`` against the
same without (1 token, best of 4 each; the two alternate within the process). Prints medians over the
rounds and the load average seen before each process.
"""

import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import json, random, time
from plinth import LLM, SamplingParams
llm = LLM(backend="cpu", num_threads=2, enable_prefix_caching=False, max_model_len=1024)
rng = random.Random(0)
long = [[rng.randrange(1000, 40000) for _ in range(512)] for _ in range(8)]
short = [[rng.randrange(1000, 40000) for _ in range(32)] for _ in range(16)]
one = SamplingParams(temperature=0, max_tokens=1)
gen = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(short[:4], SamplingParams(temperature=0, max_tokens=4))  # warm-up
def best(fn, reps=2):
    times = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return min(times)
out = {}
if AB:
    out["prefill_8x512_s"] = best(lambda: llm.generate(long, one))
    out["decode_16x64_s"] = best(lambda: llm.generate(short, gen))
if SCORE:
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    plain, with_lp = [], []
    for i in range(8):  # alternate, so drift favours neither
        for params, times in ((one, plain), (scored, with_lp)) if i % 2 == 0 else ((scored, with_lp), (one, plain)):
            t = time.perf_counter(); llm.generate([long[i % 8]], params); times.append(time.perf_counter() - t)
    out["one_512_plain_s"] = min(plain)
    out["one_512_prompt_logprobs5_s"] = min(with_lp)
print(json.dumps(out))
"""


def main() -> None:
    """Run the alternating rounds and print the table."""
    checkouts = {"A": sys.argv[1], "B": sys.argv[2]}
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    res: dict[str, dict[str, list[float]]] = {}
    ab = checkouts["A"] != "-"
    for r in range(rounds):
        for side in ("AB" if r % 2 == 0 else "BA") if ab else "B":
            root = checkouts[side]
            paths = [os.path.join(root, d) for d in ("core", "plugins/cpu", "conformance")]
            p = subprocess.run(
                [sys.executable, "-c", WORKER.replace("SCORE", str(side == "B")).replace("AB", str(ab))],
                env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
                capture_output=True,
                text=True,
            )
            if p.returncode:
                print(p.stderr[-2000:])
                sys.exit(1)
            d = json.loads(p.stdout.strip().splitlines()[-1])
            print(side, f"load {os.getloadavg()[0]:.2f}", d, file=sys.stderr, flush=True)
            for k, v in d.items():
                res.setdefault(k, {}).setdefault(side, []).append(v)
    for k, d in res.items():
        cells = " | ".join(f"{side} {statistics.median(v):.3f} s (n={len(v)})" for side, v in sorted(d.items()))
        ratio = f" | B / A {statistics.median(d['B']) / statistics.median(d['A']):.3f}" if len(d) == 2 else ""
        print(f"| {k} | {cells}{ratio} |")
    if "one_512_plain_s" in res:
        plain, scored = (
            statistics.median(res["one_512_plain_s"]["B"]),
            statistics.median(res["one_512_prompt_logprobs5_s"]["B"]),
        )
        print(f"512-token prompt, prompt_logprobs=5 / without: {scored / plain:.3f} (+{scored - plain:.3f} s)")


if __name__ == "__main__":
    main()
