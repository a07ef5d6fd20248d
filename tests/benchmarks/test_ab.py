"""benchmarks/ab.py: the steps its modes give, and a clear error for a mode it does not know."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

Bench = Callable[[str], ModuleType]


def test_plan_runs_each_mode_then_start_up_in_the_last(bench: Bench) -> None:
    names = [name for name, _ in bench("ab").plan(["bf16", "fp32"], 64)]
    assert names == [
        "throughput bf16 output tok/s",
        "batch-1 bf16 decode tok/s",
        "throughput fp32 output tok/s",
        "batch-1 fp32 decode tok/s",
        "start-up fp32 s",
    ]


def test_the_bf16_mode_asks_for_a_bf16_model_of_unquantized_weights(bench: Bench) -> None:
    ab = bench("ab")
    common = ab._common(ab.MODES["bf16"])
    last = max(i for i, arg in enumerate(common) if arg == "--dtype")  # argparse: the last --dtype wins
    assert common[last + 1] == "bfloat16"
    assert common[common.index("--quantization") + 1] == "none"


def test_an_unknown_mode_is_named(bench: Bench, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench("ab").main(["--a", ".", "--b", ".", "--modes", "fp32,int3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "int3" in err and "fp32, q4_1, bf16" in err
