"""``plinth bench prefill``: the FLOP count by hand, and the command end to end on a tiny model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from plinth.bench.prefill import FlopCounts, prefill_flops, prefill_gemm_shapes
from plinth.cli import main

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime" / "engine"))


def test_prefill_flops_by_hand() -> None:
    counts = FlopCounts(linear_params=1000, head_params=100, num_layers=2, num_heads=3, head_dim=4)
    # 2 x 1000 x 5 tokens + 2 x 100 (last position) + 2 x 2 x 2 layers x 3 heads x 4 x (5 x 6 / 2) pairs
    assert prefill_flops(counts, 5) == 10_000 + 200 + 1_440
    assert prefill_flops(counts, 1) == 2_000 + 200 + 96


def test_flop_counts_are_read_from_the_model(tmp_path: Path) -> None:
    from engine_helpers import save_tiny_folder

    from plinth import LLM

    save_tiny_folder("llama", tmp_path)  # hidden 64, intermediate 128, 2 layers, 4 heads (2 kv) of 16, vocab 49152
    llm = LLM(model=str(tmp_path), backend="cpu", num_kv_blocks=16, block_size=16)
    counts = FlopCounts.of(llm.engine.model, llm.engine.model_config)
    qkv, o, gate_up, down = (64 + 2 * 32) * 64, 64 * 64, 2 * 128 * 64, 64 * 128
    assert counts == FlopCounts(2 * (qkv + o + gate_up + down), 49152 * 64, 2, 4, 16)
    assert prefill_flops(counts, 8) == 2 * 73_728 * 8 + 2 * 3_145_728 + 4 * 2 * 4 * 16 * 36 == 7_489_536
    assert prefill_gemm_shapes(llm.engine.model, 32) == [(32, 64, 64), (32, 64, 128), (32, 64, 256), (32, 128, 64)]


def test_bench_prefill_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine_helpers import save_tiny_folder

    monkeypatch.setattr("plinth.bench.prefill.PEAK_SQUARE", (256, 256, 256))  # the 2048-cube takes seconds
    save_tiny_folder("llama", tmp_path / "model")
    out = tmp_path / "prefill.json"
    argv = ["bench", "prefill", "--model", str(tmp_path / "model"), "--backend", "cpu", "--input-len", "24"]
    argv += ["--num-prompts", "3", "--iters", "2", "--no-kv-cache-prefault", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["num_prompts"] == 3 and result["input_len"] == 24 and len(result["prefill_tok_s_runs"]) == 2
    assert result["prefill_tok_s"] == pytest.approx(72 / result["elapsed_s"], rel=0.01)
    assert result["flops_per_prompt"] == 2 * 73_728 * 24 + 2 * 3_145_728 + 4 * 2 * 4 * 16 * (24 * 25 // 2)
    assert result["gflops"] == pytest.approx(3 * result["flops_per_prompt"] / result["elapsed_s"] / 1e9, abs=0.06)
    shapes = {"256x256x256", "72x64x64", "72x64x128", "72x64x256", "72x128x64"}  # 72 rows: the whole run, one step
    for dtype in ("bfloat16", "float32"):  # torch's F.linear, and the cpu backend's own GEMM kernels
        assert set(result["gemm_peak_shapes_gflops"][dtype]) == shapes | {f"{s} cpu" for s in shapes}
        assert result["gemm_peak_gflops"][dtype] == max(result["gemm_peak_shapes_gflops"][dtype].values())
    fp32_peak = result["gemm_peak_gflops"]["float32"]
    assert result["pct_of_fp32_peak"] == pytest.approx(100 * result["gflops"] / fp32_peak, rel=0.05, abs=0.2)
    assert result["kernel_fallbacks"] == []
    assert "prefill" in capsys.readouterr().out
