"""Offline benchmarks: the workload generator and the throughput/latency measurements."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from plinth.bench.datasets import sharegpt, synthetic
from plinth.bench.latency import COLD_START_PHASES, measure_cold_start, measure_latency
from plinth.bench.throughput import pass_workloads, run_passes, run_throughput

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime" / "engine"))


def test_synthetic_workload_is_fixed_and_clipped() -> None:
    a = synthetic(200, vocab_size=49152, seed=0)
    b = synthetic(200, vocab_size=49152, seed=0)
    assert a == b
    assert all(16 <= len(r.prompt_ids) <= 512 and 16 <= r.output_len <= 256 for r in a)
    prompt_lens = sorted(len(r.prompt_ids) for r in a)
    assert 100 <= prompt_lens[100] <= 160  # median near 128
    assert synthetic(5, 49152, seed=1) != a[:5]


def test_sharegpt_file(tmp_path: Path) -> None:
    from plinth.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    data = [
        {
            "conversations": [
                {"from": "human", "value": "Tell me a story about a cat."},
                {"from": "gpt", "value": "Once " * 20},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    [req] = sharegpt(path, tok, 10)
    assert req.prompt_ids == tok.encode("Tell me a story about a cat.")
    assert req.output_len == len(tok.encode("Once " * 20, add_special_tokens=False)) >= 20
    path.write_text("[]")
    with pytest.raises(ValueError, match="no usable ShareGPT"):
        sharegpt(path, tok, 10)


def test_throughput_and_latency_on_a_tiny_model(tmp_path: Path) -> None:
    from engine_helpers import save_tiny_folder

    from plinth import LLM

    save_tiny_folder("llama", tmp_path)
    llm = LLM(model=str(tmp_path), backend="cpu", num_kv_blocks=128, block_size=16)
    requests = synthetic(6, vocab_size=49152, seed=0, prompt_range=(16, 64), output_range=(4, 12))
    result = run_throughput(llm, requests, progress=False)
    assert result["output_tokens"] == sum(r.output_len for r in requests)
    assert result["prompt_tokens"] == sum(len(r.prompt_ids) for r in requests)
    assert result["output_tok_s"] > 0 and 0 <= result["kv_waste_pct"] < 100
    assert not llm.engine.has_unfinished()
    lat = measure_latency(llm, input_len=8, output_len=6, iters=2)
    assert lat["decode_tok_s"] > 0 and lat["ttft_s"] > 0
    assert len(lat["decode_tok_s_runs"]) == len(lat["read_probe_gbps_runs"]) == 2
    assert max(lat["read_probe_gbps_runs"]) == pytest.approx(max(lat["read_probe_gbps"].values()), abs=0.1)
    assert all(0 < g <= max(lat["read_probe_gbps"].values()) for g in lat["read_probe_gbps_runs"])
    assert lat["pct_of_bandwidth_limit"] > 0
    # the model's own weights, streamed in place around each run: a limit of their own
    assert len(lat["weight_stream_gbps_runs"]) == 2 and set(lat["weight_stream_gbps"]) == set(lat["read_probe_gbps"])
    best_stream = max(lat["weight_stream_gbps"].values())
    assert max(lat["weight_stream_gbps_runs"]) == pytest.approx(best_stream, abs=0.1)
    limit = best_stream * 1e9 / (lat["weight_mb_per_token"] * 1e6)
    assert lat["weight_stream_tok_s"] == pytest.approx(limit, rel=0.02) and lat["weight_stream_tok_s"] > 0
    assert lat["pct_of_weight_stream"] > 0


def test_later_passes_do_the_same_work_on_fresh_prompts(tmp_path: Path) -> None:
    from engine_helpers import save_tiny_folder

    from plinth import LLM

    requests = synthetic(5, vocab_size=49152, seed=0, prompt_range=(16, 64), output_range=(4, 12))
    workloads = pass_workloads(requests, 3, vocab_size=49152, seed=0)
    assert workloads[0] == requests and pass_workloads(requests, 3, 49152, seed=0) == workloads  # fixed
    lengths = [(len(r.prompt_ids), r.output_len) for r in requests]
    for later in workloads[1:]:
        assert [(len(r.prompt_ids), r.output_len) for r in later] == lengths
        assert all(a.prompt_ids[:4] != b.prompt_ids[:4] for a, b in zip(later, requests, strict=True))
        assert all(256 <= i < 49152 for r in later for i in r.prompt_ids)
    assert workloads[1] != workloads[2]

    save_tiny_folder("llama", tmp_path)
    llm = LLM(model=str(tmp_path), backend="cpu", num_kv_blocks=128, block_size=16)
    result = run_passes(llm, workloads[:2], progress=False)
    assert len(result["passes_output_tok_s"]) == len(result["passes_elapsed_s"]) == 2
    assert result["output_tok_s"] == result["passes_output_tok_s"][0] > 0 and result["passes_output_tok_s"][1] > 0
    assert result["passes_prefix_cache_hit_tokens"] == [0, 0]  # pass 2 prefilled every prompt again
    again = run_passes(llm, workloads[:1], progress=False)  # the same prompts once more: cached
    assert again["passes_prefix_cache_hit_tokens"][0] > 0


def test_bench_throughput_passes_end_to_end(tmp_path: Path) -> None:
    from engine_helpers import save_tiny_folder

    from plinth.cli import main

    save_tiny_folder("llama", tmp_path / "model")
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", str(tmp_path / "model"), "--backend", "cpu", "--num-prompts", "3"]
    assert main([*argv, "--passes", "2", "--no-progress", "--no-kv-cache-prefault", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["passes_output_tok_s"]) == 2 and result["passes_prefix_cache_hit_tokens"] == [0, 0]
    assert result["output_tok_s"] == result["passes_output_tok_s"][0]


def test_cold_start_is_process_start_to_first_token_with_its_phases(tmp_path: Path) -> None:
    from engine_helpers import save_tiny_folder

    save_tiny_folder("llama", tmp_path)
    result = measure_cold_start(str(tmp_path), "cpu")
    phases = result["cold_start_phases_s"]
    assert tuple(phases) == COLD_START_PHASES
    assert all(v >= -0.01 for v in phases.values())  # engine_other mixes two clocks: ms of jitter
    assert result["cold_start_s"] > 0
    assert sum(phases.values()) == pytest.approx(result["cold_start_s"], abs=0.02)


def test_speculative_side_by_side_on_a_tiny_model(tmp_path: Path) -> None:
    from engine_helpers import save_tiny_folder

    from plinth import LLM
    from plinth.bench.speculative import measure_speculative, spec_summary

    save_tiny_folder("llama", tmp_path)
    options = dict(model=str(tmp_path), backend="cpu", num_kv_blocks=128, block_size=16)
    plain, spec = LLM(**options), LLM(**options, num_speculative_tokens=3)  # type: ignore[arg-type]
    result = measure_speculative(plain, spec, max_tokens=12, iters=1)
    for name in ("repetitive", "non_repetitive"):
        r = result[name]
        assert r["plain_decode_tok_s"] > 0 and r["spec_decode_tok_s"] > 0 and r["requests"] == 4
        assert 0.0 <= r["acceptance_rate"] <= 1.0
    summary = spec_summary(spec.engine.scheduler)
    assert summary["spec_drafts"] > 0  # the tiny model repeats itself: drafts are proposed
    assert summary["spec_accepted_tokens_per_step"] <= 3
