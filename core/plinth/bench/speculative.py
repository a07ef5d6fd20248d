"""``plinth bench speculative``: batch-1 decode with and without n-gram speculative decoding, side by side.

Two engines on the same options, one with ``--num-speculative-tokens`` (default 4), run the same two
workloads one request at a time, the engines taking turns request by request (so a drift in the
machine's speed reaches both alike): a *repetitive* one whose answers copy the prompt (repeat or edit
a piece of code: what prompt-lookup drafting is for) and a *non-repetitive* one (open questions, whose
answers rarely repeat the prompt). Greedy, natural stops, the same tokens from both engines (checked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from plinth.bench import BenchError, output_path
from plinth.engine_args import add_engine_arguments, engine_options, positive_int

#: a function the repetitive workload asks the model to repeat or edit (the engine tests use it too)
SAMPLE_CODE = """def parse_config(path):
    with open(path) as f:
        lines = f.read().splitlines()
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config
"""
_CODE2 = """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def __len__(self):
        return len(self.items)
"""

#: chat messages whose answers copy much of the prompt (code editing)
REPETITIVE = [
    f"Here is a function:\n\n```python\n{SAMPLE_CODE}```\n\nRepeat it exactly, in a code block, with no other text.",
    f"```python\n{SAMPLE_CODE}```\n\nRename `config` to `settings` in this function. "
    "Reply with the whole function only.",
    f"```python\n{_CODE2}```\n\nAdd type hints to this class. Reply with the whole class only.",
    f"```python\n{_CODE2}```\n\nRename the class to `LifoStack`. Reply with the whole class only, in a code block.",
]
#: chat messages whose answers rarely repeat the prompt
NON_REPETITIVE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give five tips for learning a new language as an adult.",
    "What are the main differences between a virus and a bacterium?",
]


def add_bench_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``plinth bench speculative`` (``--num-speculative-tokens`` defaults to 4 here)."""
    add_engine_arguments(p)
    p.set_defaults(num_speculative_tokens=4)
    p.add_argument("--max-tokens", type=positive_int, default=160, help="tokens per answer at most (default 160)")
    p.add_argument("--iters", type=positive_int, default=2, help="passes over each workload (after a warm-up)")
    p.add_argument("--json", type=output_path, default=None, help="write the results to this JSON file (default: none)")


def spec_summary(scheduler: Any) -> dict[str, Any]:
    """The scheduler's speculative-decoding counters, and the acceptance rate and tokens per step."""
    s = scheduler.spec_stats
    return {
        "spec_drafts": s.num_drafts,
        "spec_draft_tokens": s.num_draft_tokens,
        "spec_accepted_tokens": s.num_accepted_tokens,
        "spec_acceptance_rate": round(s.acceptance_rate, 3),
        "spec_accepted_tokens_per_step": round(s.num_accepted_tokens / s.num_drafts, 2) if s.num_drafts else 0.0,
    }


def _decode_rate(llm: Any, prompt: str, max_tokens: int) -> tuple[float, list[int]]:
    """Batch-1 decode tok/s of one greedy chat answer, and its tokens."""
    from plinth.sampling_params import SamplingParams

    [out] = llm.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=max_tokens))
    rate = out.metrics.decode_tokens_per_s
    if rate is None:
        raise BenchError(f"an answer of {len(out.outputs[0].token_ids)} tokens gives no decode speed")
    return rate, list(out.outputs[0].token_ids)


def measure_speculative(plain: Any, spec: Any, max_tokens: int, iters: int) -> dict[str, Any]:
    """Per workload: decode tok/s of both engines (the mean over requests of each one's rate, and
    the median over ``iters`` passes), the speed-up, and the speculative engine's acceptance."""
    result: dict[str, Any] = {}
    for name, prompts in (("repetitive", REPETITIVE), ("non_repetitive", NON_REPETITIVE)):
        _decode_rate(plain, prompts[0], 8)  # warm-up: step graphs, first-touch of the KV pages
        _decode_rate(spec, prompts[0], 8)
        before = spec_summary(spec.engine.scheduler)
        rates: dict[str, list[float]] = {"plain": [], "spec": []}
        tokens = 0
        for _ in range(iters):
            passes: dict[str, list[float]] = {"plain": [], "spec": []}
            for prompt in prompts:
                rate_p, ids_p = _decode_rate(plain, prompt, max_tokens)
                rate_s, ids_s = _decode_rate(spec, prompt, max_tokens)
                if ids_p != ids_s:
                    raise BenchError(f"speculation changed the greedy answer to {prompt[:40]!r}")
                passes["plain"].append(rate_p)
                passes["spec"].append(rate_s)
                tokens += len(ids_p)
            for k in rates:
                rates[k].append(statistics.fmean(passes[k]))
        after = spec_summary(spec.engine.scheduler)
        drafts = after["spec_drafts"] - before["spec_drafts"]
        proposed = after["spec_draft_tokens"] - before["spec_draft_tokens"]
        accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        plain_rate, spec_rate = statistics.median(rates["plain"]), statistics.median(rates["spec"])
        result[name] = {
            "requests": len(prompts) * iters,
            "output_tokens": tokens,
            "plain_decode_tok_s": round(plain_rate, 2),
            "spec_decode_tok_s": round(spec_rate, 2),
            "speedup": round(spec_rate / plain_rate, 3),
            "plain_runs": [round(r, 2) for r in rates["plain"]],
            "spec_runs": [round(r, 2) for r in rates["spec"]],
            "acceptance_rate": round(accepted / proposed, 3) if proposed else 0.0,
            "accepted_tokens_per_step": round(accepted / drafts, 2) if drafts else 0.0,
            "draft_steps_per_output_token": round(drafts / tokens, 3) if tokens else 0.0,
        }
    return result


def run_bench_speculative(args: argparse.Namespace) -> int:
    """Entry point of ``plinth bench speculative``."""
    import torch

    from plinth.llm import LLM

    options = engine_options(args)
    k = options.pop("num_speculative_tokens", 4)
    if k < 1:
        raise BenchError("--num-speculative-tokens must be at least 1 here (it is the engine compared)")
    t0 = time.monotonic()
    plain = LLM(**options)
    spec = LLM(**options, num_speculative_tokens=k)
    result: dict[str, Any] = {
        "backend": plain.engine.backend.name,
        "num_speculative_tokens": k,
        "ngram_prompt_lookup_max": spec.engine.config.ngram_prompt_lookup_max,
        "ngram_prompt_lookup_min": spec.engine.config.ngram_prompt_lookup_min,
        "threads": torch.get_num_threads(),
        **measure_speculative(plain, spec, args.max_tokens, args.iters),
    }
    result["elapsed_s"] = round(time.monotonic() - t0, 1)
    print(
        f"{result['backend']}, batch 1, greedy, k={k}, n-gram {result['ngram_prompt_lookup_min']}-"
        f"{result['ngram_prompt_lookup_max']}, {result['threads']} threads:"
    )
    for name in ("repetitive", "non_repetitive"):
        r = result[name]
        print(
            f"  {name:>14}: {r['plain_decode_tok_s']:.1f} -> {r['spec_decode_tok_s']:.1f} decode tok/s "
            f"(x{r['speedup']:.2f}; runs {r['plain_runs']} vs {r['spec_runs']}), acceptance "
            f"{100 * r['acceptance_rate']:.0f}%, {r['accepted_tokens_per_step']:.2f} accepted tokens per step with "
            f"drafts, {r['output_tokens']} tokens"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
