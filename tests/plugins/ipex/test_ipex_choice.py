"""The per-op choice of plinth-ipex: an op is contributed only where it measured faster.

Pure Python (no torch, no IPEX): runs in the main environment too."""

from __future__ import annotations

import json
from typing import Any

import pytest
from plinth_ipex.choice import MEASURED_PATH, MIN_SPEEDUP, OPS, OPS_ENV, choose, decide, geomean, load_measured


def _entry(*pairs: tuple[float, float], variant: str = "mkl") -> dict[str, Any]:
    """A measured op whose cases have (cpu_us, ipex_us) ``pairs``."""
    return {"variant": variant, "cases": {f"case{i}": {"cpu_us": c, "ipex_us": i_} for i, (c, i_) in enumerate(pairs)}}


TABLE = {
    "hosts": {
        "AVX2": {
            "ops": {
                "gemm/float32": _entry((100, 250), (1000, 1500)),  # slower everywhere
                "attention/float32": _entry((300, 100), (90, 100)),  # 3x and 0.9x: 1.64x overall
                "attention/bfloat16": _entry((104, 100), (104, 100), variant="paged"),  # 1.04x: within noise
            },
            "unavailable": {"gemm/bfloat16/onednn": "AssertionError: BF16 weight prepack needs avx512bw"},
        }
    }
}


def test_a_slower_op_is_not_chosen_and_a_faster_one_is() -> None:
    verdicts = choose("AVX2", TABLE, env={})
    assert not verdicts["gemm/float32"].chosen
    assert "0.52x" in verdicts["gemm/float32"].reason and "not chosen" in verdicts["gemm/float32"].reason
    assert verdicts["attention/float32"].chosen and "1.64x" in verdicts["attention/float32"].reason
    # faster, but by less than the noise margin
    assert not verdicts["attention/bfloat16"].chosen
    assert f"below {MIN_SPEEDUP}x" in verdicts["attention/bfloat16"].reason
    # IPEX could not run it when measured: not chosen, with IPEX's reason
    assert not verdicts["gemm/bfloat16"].chosen and "cannot run it on AVX2" in verdicts["gemm/bfloat16"].reason
    assert "avx512bw" in verdicts["gemm/bfloat16"].reason


def test_an_unmeasured_host_kind_gets_nothing() -> None:
    verdicts = choose("AMX", TABLE, env={})
    assert set(verdicts) == set(OPS)
    assert not any(v.chosen for v in verdicts.values())
    assert all("not measured on AMX hosts" in v.reason for v in verdicts.values())


def test_the_geometric_mean_weighs_a_speedup_and_a_slowdown_alike() -> None:
    assert geomean([2.0, 0.5]) == pytest.approx(1.0)
    assert decide("gemm/float32", {"ops": {"gemm/float32": _entry((200, 100), (50, 100))}}, "AVX2").chosen is False
    with pytest.raises(ValueError, match="positive"):
        geomean([1.0, 0.0])


@pytest.mark.parametrize(
    "setting,want",
    [
        ("all", set(OPS)),
        ("none", set()),
        ("measured", {"attention/float32"}),
        ("gemm/float32, attention/bfloat16", {"gemm/float32", "attention/bfloat16"}),
    ],
)
def test_the_env_overrides_the_table(setting: str, want: set[str]) -> None:
    verdicts = choose("AVX2", TABLE, env={OPS_ENV: setting})
    assert {k for k, v in verdicts.items() if v.chosen} == want
    assert verdicts["gemm/float32"].variant == "mkl"  # a forced op keeps its measured variant
    if setting != "measured":
        assert all(OPS_ENV in v.reason for v in verdicts.values())


def test_an_unknown_op_in_the_env_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"PLINTH_IPEX_OPS='gemm/float64'.*gemm/float64 not among"):
        choose("AVX2", TABLE, env={OPS_ENV: "gemm/float64"})


def test_the_committed_table_is_well_formed() -> None:
    """Every measured op has cases with both timings, and names the conditions it was measured in."""
    data = load_measured()
    assert data == json.loads(MEASURED_PATH.read_text())
    assert data["hosts"], "measured.json holds no host kind: run benchmarks/ipex.py --write"
    for kind, table in data["hosts"].items():
        assert table["conditions"]["isa_level"] == kind and table["conditions"]["threads"] >= 1
        for key, entry in table["ops"].items():
            assert key in OPS and entry["cases"]
            assert all(c["cpu_us"] > 0 and c["ipex_us"] > 0 for c in entry["cases"].values())
            decide(key, table, kind)  # computes
