"""benchmarks/attention.py's summary over --processes: medians, ranges and per-process ratios."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

Bench = Callable[[str], ModuleType]


def test_summary_takes_medians_and_ratios_per_process(bench: Bench) -> None:
    summarize = bench("attention").summarize
    # one process slow for both libraries (as on a shared host): the per-process ratios still agree
    results = [
        {"case": "64x225x1", "gflops": {"this tree": 60.0, "HEAD": 50.0}, "diff": 0.0},
        {"case": "64x225x1", "gflops": {"this tree": 36.0, "HEAD": 30.0}, "diff": 0.0},
        {"case": "64x225x1", "gflops": {"this tree": 66.0, "HEAD": 60.0}, "diff": 0.0},
        {"case": "8x512x512", "gflops": {"this tree": 100.0, "HEAD": 125.0}, "diff": 1e-6},
    ]
    decode, prefill = summarize(results, "HEAD")
    assert decode.startswith("      64x225x1: this tree 60.0 (36.0-66.0) GFLOP/s, HEAD 50.0 (30.0-60.0) GFLOP/s")
    assert "ratio median 1.20x (1.10-1.20x, this tree faster in 3 of 3)" in decode
    assert decode.endswith("max |diff| 0.00e+00")
    assert "ratio median 0.80x (0.80-0.80x, this tree faster in 0 of 1)" in prefill
    assert prefill.endswith("max |diff| 1.00e-06")


def test_summary_without_a_reference_has_no_ratio(bench: Bench) -> None:
    [line] = bench("attention").summarize([{"case": "1x4096x1", "gflops": {"this tree": 40.0}, "diff": None}], None)
    assert line == "      1x4096x1: this tree 40.0 (40.0-40.0) GFLOP/s"


def test_child_command_passes_the_built_revision_and_options(bench: Bench) -> None:
    import argparse

    args = argparse.Namespace(cases=["64x225x1"], heads="9/3/64", block_size=16, cache_dtype="float8_e4m3fn",
                              threads=2, repeats=50, bf16_queries=True, amx=False, against="HEAD",
                              layers=30)  # fmt: skip
    cmd = bench("attention").child_command(args, Path("/tmp/lib-avx512.so"))
    assert cmd[1].endswith("benchmarks/attention.py") and "--json-lines" in cmd and "--bf16-queries" in cmd
    assert cmd[cmd.index("--against-lib") + 1] == "/tmp/lib-avx512.so" and "--processes" not in cmd
    assert cmd[cmd.index("--cache-dtype") + 1] == "float8_e4m3fn" and cmd[cmd.index("--layers") + 1] == "30"


def test_case_gives_each_layer_its_own_filled_cache(bench: Bench) -> None:
    import torch

    c = bench("attention").case(2, 40, 1, 9, 3, 64, 16, torch.bfloat16, torch.Generator().manual_seed(0), layers=3)
    caches = c["caches"]
    assert len(caches) == 3 and caches[0].shape == (2, 7, 3, 16, 64) and caches[0].dtype == torch.bfloat16
    assert len({t.data_ptr() for t in caches}) == 3 and not torch.equal(caches[0], caches[1])  # filled, apart
    assert c["flops"] == 3 * 4 * 64 * 9 * 2 * 40
    assert c["tables"].shape == (2, 3) and len(set(c["tables"].flatten().tolist())) == 6
