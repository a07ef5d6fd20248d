"""Structured output: the grammar libraries compared, and what constraints cost the engine.

    .venv/bin/python benchmarks/structured.py [--json OUT] [--skip-engine]

Part 1 walks every instance of :data:`plinth.bench.schemas.SCHEMAS` token by token (SmolLM2's 49k
tokenizer) through llguidance and, when it is installed (``pip install xgrammar``; plinth does not
depend on it), xgrammar: compile time per schema, the mask time per token (one matcher, one thread),
whether each instance was admitted, whether the unenforceable schemas were refused, and the mask time
of a batch of 64 matchers. Part 2 runs the engine on the default model: the schema table's prompts
free and constrained (same prompts, same token counts: ``ignore_eos`` free, constrained until the
grammar ends), alternated; and the time the mask thread spent filling against the time the sampler
waited for it (how much of the mask work the forward hides).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from plinth.bench.schemas import SCHEMAS, UNENFORCEABLE
from plinth.model.loader import load_tokenizer, resolve_model

Walk = Callable[[dict[str, Any], list[int]], "tuple[float, list[float], bool] | str"]


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        text = f.read()
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = sorted({w for w in text.split() if w.startswith(("avx512", "amx"))})
    return f"{name} ({platform.machine()}; {' '.join(flags) or 'no AVX-512/AMX'})"


def _allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def _llguidance(tok: Any, vocab: int) -> tuple[Walk, Callable[[dict[str, Any]], str], Callable[[int], float]]:
    import llguidance

    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=tok.eos_token_ids)
    options: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def walk(schema: dict[str, Any], ids: list[int]) -> tuple[float, list[float], bool] | str:
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options))
        if matcher.is_error():
            return matcher.get_error()
        compile_s = time.perf_counter() - start
        bitmask = torch.zeros(1, -(-vocab // 32), dtype=torch.int32)
        times = []
        for token in [*ids, tok.eos_token_ids[0]]:
            start = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
            times.append(time.perf_counter() - start)
            if not _allowed(bitmask, token):
                return compile_s, times, False
            matcher.consume_token(token)
        return compile_s, times, True

    def refuse(schema: dict[str, Any]) -> str:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        return llguidance.LLMatcher.validate_grammar(grammar, lltok) or "ACCEPTED"

    def batch(n: int) -> float:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMAS[-2].schema, defaults=options)
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(n)]
        for i, m in enumerate(matchers):  # spread them over the walk: different states
            m.consume_tokens(tok.encode('{"location": "Paris"'[: 2 + i % 16], add_special_tokens=False))
        executor = llguidance.LLExecutor()
        bitmask = torch.zeros(n, -(-vocab // 32), dtype=torch.int32)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                             bitmask.shape[1] * 4, n)  # fmt: skip
            best = min(best, time.perf_counter() - start)
        return best

    return walk, refuse, batch


def _xgrammar(tok: Any, vocab: int) -> tuple[Walk, Callable[[dict[str, Any]], str], Callable[[int], float]] | None:
    try:
        import xgrammar
    except ImportError:
        return None
    special = {i for i, t in tok.backend.get_added_tokens_decoder().items() if t.special}
    encoded = [b"" if i in special else tok.token_bytes(i) for i in range(vocab)]
    info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.RAW, vocab_size=vocab, stop_token_ids=tok.eos_token_ids)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compiled(schema: dict[str, Any]) -> Any:
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    def walk(schema: dict[str, Any], ids: list[int]) -> tuple[float, list[float], bool] | str:
        start = time.perf_counter()
        try:
            grammar = compiled(schema)
        except Exception as exc:  # noqa: BLE001 - any refusal is a row of the table
            return str(exc)
        compile_s = time.perf_counter() - start
        matcher = xgrammar.GrammarMatcher(grammar)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        times = []
        for token in [*ids, tok.eos_token_ids[0]]:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - start)
            if not _allowed(bitmask, token):
                return compile_s, times, False
            matcher.accept_token(token)
        return compile_s, times, True

    def refuse(schema: dict[str, Any]) -> str:
        try:
            compiled(schema)
        except Exception as exc:  # noqa: BLE001
            return str(exc)
        return "ACCEPTED"

    def batch(n: int) -> float:
        grammar = compiled(SCHEMAS[-2].schema)
        matchers = [xgrammar.GrammarMatcher(grammar) for _ in range(n)]
        for i, m in enumerate(matchers):
            for t in tok.encode('{"location": "Paris"'[: 2 + i % 16], add_special_tokens=False):
                m.accept_token(t)
        batched = xgrammar.BatchGrammarMatcher()
        bitmask = xgrammar.allocate_token_bitmask(n, vocab)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            batched.batch_fill_next_token_bitmask(matchers, bitmask)
            best = min(best, time.perf_counter() - start)
        return best

    return walk, refuse, batch


def libraries() -> dict[str, Any]:
    """Part 1: per-schema and per-token figures of each library."""
    tok = load_tokenizer(resolve_model(None))
    vocab = tok.vocab_size
    report: dict[str, Any] = {}
    for name, make in (("llguidance", _llguidance), ("xgrammar", _xgrammar)):
        made = make(tok, vocab)
        if made is None:
            print(f"{name}: not installed, skipped")
            continue
        walk, refuse, batch = made
        rows, masks, admitted = [], [], 0
        for case in SCHEMAS:
            ids = tok.encode(json.dumps(case.instance, separators=(", ", ": ")), add_special_tokens=False)
            result = walk(case.schema, ids)
            if isinstance(result, str):
                rows.append({"schema": case.name, "error": result[:120]})
                continue
            compile_s, times, ok = result
            admitted += ok
            masks += times
            rows.append({"schema": case.name, "compile_ms": compile_s * 1e3, "admitted": ok})
        masks.sort()
        refused = {kw: refuse(schema)[:80] for kw, schema in UNENFORCEABLE.items()}
        per_token = {
            "tokens": len(masks),
            "median_us": masks[len(masks) // 2] * 1e6,
            "p99_us": masks[int(len(masks) * 0.99)] * 1e6,
            "mean_us": statistics.mean(masks) * 1e6,
        }
        compile_ms = sorted(r["compile_ms"] for r in rows if "compile_ms" in r)
        report[name] = {
            "admitted": f"{admitted}/{len(SCHEMAS)}",
            "compile_ms_median": compile_ms[len(compile_ms) // 2],
            "compile_ms_max": compile_ms[-1],
            "mask": per_token,
            "batch64_ms": batch(64) * 1e3,
            "unenforceable": refused,
            "schemas": rows,
        }
        print(
            f"{name}: admitted {admitted}/{len(SCHEMAS)}; compile median {compile_ms[len(compile_ms) // 2]:.1f} ms "
            f"(max {compile_ms[-1]:.1f}); mask per token median {per_token['median_us']:.0f} us, "
            f"p99 {per_token['p99_us']:.0f} us, mean {per_token['mean_us']:.0f} us over {len(masks)} tokens; "
            f"64 matchers in one call {report[name]['batch64_ms']:.2f} ms"
        )
        for kw, verdict in refused.items():
            print(f"  {kw}: {verdict}")
    return report


def engine(rounds: int) -> dict[str, Any]:
    """Part 2: the engine with and without constraints, alternated, on the schema table's prompts."""
    from plinth import LLM, SamplingParams
    from plinth.sampling_params import StructuredOutputs

    llm = LLM(max_model_len=1024, num_threads=2)
    prompts = [f"Write one JSON value that matches this JSON schema: {json.dumps(c.schema)}\nJSON:" for c in SCHEMAS]
    constrained = [
        SamplingParams(temperature=0, max_tokens=64, structured=StructuredOutputs(json=c.schema)) for c in SCHEMAS
    ]
    outs = llm.generate(prompts, constrained)  # warm-up, and the token counts the free run matches
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    tokens = sum(lengths)
    figures: dict[str, list[float]] = {"free": [], "constrained": []}
    structured = llm.engine.structured
    fill = wait = 0.0
    for r in range(rounds):
        for label in ("free", "constrained") if r % 2 == 0 else ("constrained", "free"):
            fill0, wait0 = structured.fill_seconds, structured.wait_seconds
            start = time.perf_counter()
            llm.generate(prompts, constrained if label == "constrained" else free)
            figures[label].append(tokens / (time.perf_counter() - start))
            fill += structured.fill_seconds - fill0
            wait += structured.wait_seconds - wait0
    one = SamplingParams(temperature=0, max_tokens=48, structured=StructuredOutputs(json=SCHEMAS[2].schema))
    out = llm.generate([prompts[2]], one)[0].outputs[0]
    batch1: dict[str, list[float]] = {"free": [], "constrained": []}
    free1 = SamplingParams(temperature=0, max_tokens=len(out.token_ids), ignore_eos=True)
    for r in range(rounds):
        for label in ("free", "constrained") if r % 2 == 0 else ("constrained", "free"):
            start = time.perf_counter()
            llm.generate([prompts[2]], one if label == "constrained" else free1)
            batch1[label].append(len(out.token_ids) / (time.perf_counter() - start))
    result = {
        "requests": len(prompts),
        "output_tokens": tokens,
        "throughput_tok_s": {k: statistics.median(v) for k, v in figures.items()},
        "batch1_tok_s": {k: statistics.median(v) for k, v in batch1.items()},
        "mask_fill_s": fill / rounds,
        "sampler_wait_s": wait / rounds,
    }
    print(
        f"engine ({len(prompts)} requests, {tokens} output tokens, 2 threads, default model): throughput free "
        f"{result['throughput_tok_s']['free']:.0f} tok/s, constrained {result['throughput_tok_s']['constrained']:.0f}; "
        f"batch-1 free {result['batch1_tok_s']['free']:.1f} tok/s, constrained "
        f"{result['batch1_tok_s']['constrained']:.1f}; per pass the mask thread filled for "
        f"{result['mask_fill_s'] * 1e3:.0f} ms and the sampler waited {result['sampler_wait_s'] * 1e3:.1f} ms"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict[str, Any] = {"cpu": _cpu(), "load_before": os.getloadavg()[0]}
    print(f"host: {report['cpu']}; 1-minute load {report['load_before']:.2f}")
    report["libraries"] = libraries()
    if not args.skip_engine:
        torch.set_num_threads(2)
        report["engine"] = engine(args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
