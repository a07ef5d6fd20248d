"""``plinth bench prefill``: prompt processing speed, set against the device's GEMM peak measured in
the same process right after."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

from plinth.bench import output_path
from plinth.bench.roofline import PEAK_SQUARE, gemm_peak
from plinth.engine_args import add_engine_arguments, add_kv_cache_prefault_argument, engine_options, positive_int


def add_bench_prefill_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``plinth bench prefill``."""
    add_engine_arguments(p)
    p.add_argument("--input-len", type=positive_int, default=512, help="tokens per prompt (random ids)")
    p.add_argument("--num-prompts", type=positive_int, default=8, help="prompts per run, submitted at once")
    p.add_argument("--iters", type=positive_int, default=3, help="measured runs (after one warm-up run)")
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="sequences in one step at most")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=1024, help="token budget of one step")
    add_kv_cache_prefault_argument(p)
    p.add_argument("--json", type=output_path, default=None, help="write the results to this JSON file (default: none)")


@dataclass(frozen=True, slots=True)
class FlopCounts:
    """What a prompt's prefill FLOPs depend on, read from a loaded model (:meth:`of`)."""

    linear_params: int  # weights of the decoder's linear layers, every one used by every token
    head_params: int  # the LM head's weights, used by the last position only
    num_layers: int
    num_heads: int  # query heads
    head_dim: int

    @classmethod
    def of(cls, model: Any, config: Any) -> FlopCounts:
        """From ``model``'s :class:`~plinth.model.layers.Linear` modules (their logical shapes) and
        its :class:`~plinth.model.config.ModelConfig`. A MoE model's experts are not ``Linear``
        modules, so they are left out (its figure is low)."""
        from plinth.model.layers import Linear

        head = getattr(model, "lm_head", None)
        linear = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Linear) and m is not head)
        head_params = head.in_features * head.out_features if isinstance(head, Linear) else 0
        return cls(linear, head_params, config.num_layers, config.num_heads, config.head_dim)


def prefill_flops(counts: FlopCounts, prompt_len: int) -> int:
    """FLOPs of the prefill of one prompt of ``prompt_len`` (L) tokens, counting a multiply-add as 2:

    - linear layers: ``2 x linear_params x L`` (every token through every decoder weight);
    - the LM head: ``2 x head_params`` (only the last position's logits are computed);
    - causal attention: ``2 x 2 x layers x heads x head_dim x L(L+1)/2``: the scores ``q k^T`` and
      the weighted sum ``p v``, each ``head_dim`` multiply-adds per (query, key) pair, over the
      ``L(L+1)/2`` pairs a causal mask keeps (every layer full attention: a sliding window's layers
      do less).

    Norms, rotary embeddings, activations and the softmax are left out (a few FLOPs per element,
    not per weight).
    """
    linear = 2 * counts.linear_params * prompt_len
    head = 2 * counts.head_params
    attention = 2 * 2 * counts.num_layers * counts.num_heads * counts.head_dim * prompt_len * (prompt_len + 1) // 2
    return linear + head + attention


def prefill_gemm_shapes(model: Any, tokens: int) -> list[tuple[int, int, int]]:
    """The ``(M, K, N)`` of the decoder's linear layers in a prefill step of ``tokens`` rows, each once."""
    from plinth.model.layers import Linear

    head = getattr(model, "lm_head", None)
    shapes = {(m.in_features, m.out_features) for m in model.modules() if isinstance(m, Linear) and m is not head}
    return [(tokens, k, n) for k, n in sorted(shapes)]


def measure_prefill(llm: Any, input_len: int, num_prompts: int, iters: int) -> dict[str, Any]:
    """Prefill tok/s: ``num_prompts`` prompts of ``input_len`` fresh random ids (no prefix-cache hit)
    submitted at once, one token each, timed around ``generate``; the median of ``iters`` runs after
    one warm-up. Then, in the same process, the GEMM peak of the backend's device in bf16 and fp32
    (:func:`~plinth.bench.roofline.gemm_peak` over a 2048-cube and the model's own prefill shapes, by
    torch and by the backend's own GEMM kernels)
    and the share of each peak the prefill's FLOPs (:func:`prefill_flops`) reached."""
    import random

    from plinth.sampling_params import SamplingParams

    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    services = engine.backend.device_services()
    times = []
    for i in range(iters + 1):
        prompts = [[rng.randrange(256, vocab) for _ in range(input_len)] for _ in range(num_prompts)]
        services.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        services.synchronize()
        if i > 0:  # the first run is the warm-up
            times.append(time.perf_counter() - t0)
    elapsed = statistics.median(times)
    tokens = num_prompts * input_len
    counts = FlopCounts.of(engine.model, engine.model_config)
    flops = prefill_flops(counts, input_len)
    achieved = num_prompts * flops / elapsed / 1e9
    step_rows = min(tokens, engine.config.max_num_batched_tokens)  # rows of a full prefill step
    peaks = gemm_peak(services, [PEAK_SQUARE, *prefill_gemm_shapes(engine.model, step_rows)], backend=engine.backend)
    peak = {dtype: max(figures.values()) for dtype, figures in peaks.items()}
    return {
        "backend": engine.backend.name,
        "dtype": str(getattr(engine.model, "dtype", "-")).removeprefix("torch."),
        "input_len": input_len,
        "num_prompts": num_prompts,
        "prefill_tok_s": round(tokens / elapsed, 1),
        "prefill_tok_s_runs": [round(tokens / t, 1) for t in times],
        "elapsed_s": round(elapsed, 6),
        "flops_per_prompt": flops,
        "gflops": round(achieved, 1),
        "gemm_peak_gflops": {dtype: round(p, 1) for dtype, p in peak.items()},
        "gemm_peak_shapes_gflops": {d: {s: round(g, 1) for s, g in f.items()} for d, f in peaks.items()},
        "pct_of_bf16_peak": round(100 * achieved / peak["bfloat16"], 1),
        "pct_of_fp32_peak": round(100 * achieved / peak["float32"], 1),
    }


def run_bench_prefill(args: argparse.Namespace) -> int:
    """Entry point of ``plinth bench prefill``."""
    from plinth.llm import LLM

    llm = LLM(**engine_options(args))
    result = measure_prefill(llm, args.input_len, args.num_prompts, args.iters)
    # ops that ran on the reference kernel: figures measured with any are not the backend's
    result["kernel_fallbacks"] = list(llm.engine.kernels.fallbacks)
    peak = result["gemm_peak_gflops"]
    print(
        f"{result['backend']} ({result['dtype']}): prefill {result['prefill_tok_s']:.1f} tok/s "
        f"({args.num_prompts} prompts of {args.input_len} tokens, median of {result['prefill_tok_s_runs']}), "
        f"{result['flops_per_prompt'] / 1e9:.2f} GFLOP per prompt -> {result['gflops']:.1f} GFLOP/s\n"
        f"  GEMM peak (torch F.linear or the backend's GEMM kernels, same process, best shape): "
        f"bf16 {peak['bfloat16']:.1f} GFLOP/s, fp32 "
        f"{peak['float32']:.1f} GFLOP/s; prefill reaches {result['pct_of_bf16_peak']:.0f}% of the bf16 peak, "
        f"{result['pct_of_fp32_peak']:.0f}% of the fp32 peak (by shape: {result['gemm_peak_shapes_gflops']})"
    )
    for note in result["kernel_fallbacks"]:
        print(f"  reference fallback: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
