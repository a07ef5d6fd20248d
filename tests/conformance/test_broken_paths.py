"""The suite catches the classes of bug issue 17 found passing it: each broken backend of
broken_paths.py (all of which suite 1.1 certified, every tier) fails, in the tier and the cases
that reach its path, for its own reason; the cases next to them still pass."""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from plinth_conformance.cli import suite_args

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent
MODULE = "plinth_broken_paths"


@pytest.fixture(scope="module")
def paths_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fake installed distribution with one ``plinth.backends`` entry point per broken backend."""
    root = tmp_path_factory.mktemp("paths_site")
    shutil.copy(HERE / "broken_backends.py", root / "plinth_broken_backends.py")
    shutil.copy(HERE / "broken_paths.py", root / f"{MODULE}.py")
    info = root / "plinth_broken_paths-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plinth-broken-paths\nVersion: 0.0.1\n")
    names = re.findall(r'_backend\("broken_(\w+)"|name = "broken_(\w+)"', (HERE / "broken_paths.py").read_text())
    lines = "\n".join(f"broken_{a or b} = {MODULE}:{a or b}" for a, b in names)
    (info / "entry_points.txt").write_text(f"[plinth.backends]\n{lines}\n")
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for mod in (MODULE, "plinth_broken_backends"):
        sys.modules.pop(mod, None)


def _run(pytester: pytest.Pytester, backend: str, tier: str, keyword: str) -> tuple[dict[str, str], pytest.RunResult]:
    """Case id -> message of every failed case (the suite's own end-of-run list), and the run."""
    result = pytester.runpytest(*suite_args(backend, tier, keyword=keyword))
    failed = {}
    for line in result.outlines:
        m = re.match(r"FAILED (?P<case>\S+) \(seed \d+\): (?P<msg>.*)", line)
        if m:
            failed[m["case"]] = m["msg"]
    return failed, result


def _passed(result: pytest.RunResult) -> int:
    return result.parseoutcomes().get("passed", 0)


# -- 1: every declared value ---------------------------------------------------------------------


def test_gqa_groups_above_8_are_exercised(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, result = _run(pytester, "broken_gqa_over_8", "extended", "attn-f32-h64-bs16-g")
    # (16x1 passes: with one KV head every tile reads it)
    assert set(failed) == {f"attn-f32-h64-bs16-g{g}-{k}" for g in ("9x2", "12x2") for k in ("decode", "mixed")}
    assert all("relative error" in m for m in failed.values()), failed
    assert _passed(result) >= 8  # groups 1-8, 3 KV heads, 5 KV heads


def test_odd_kv_head_counts_are_exercised(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, result = _run(pytester, "broken_odd_kv_heads", "extended", "attn-f32-h64-bs16-g")
    odd = {f"attn-f32-h64-bs16-g{g}-{k}" for g in ("3x3", "1x3", "7x3", "6x5") for k in ("decode", "mixed")}
    assert set(failed) == odd, failed  # 1 and 2 KV heads (all suite 1.1 tried) pass
    assert _passed(result) >= 6


def test_every_declared_head_size_is_swept(pytester: pytest.Pytester, paths_site: Path) -> None:
    """Declares 16..256 step 8; sizes no multiple of 16 lose their score tail. 64/80/96/128/256 pass."""
    failed, _ = _run(pytester, "broken_head_tail", "extended", "attn-sweep or attn-f32-h80 or attn-f32-h96")
    assert set(failed) == {"attn-sweep-f32-bs16-heads"}, failed
    msg = failed["attn-sweep-f32-bs16-heads"]
    assert "15 of 31 head sizes fail" in msg and "[attn-sweep-f32-bs16-heads:h24]" in msg, msg


def test_kv_cache_dtypes_that_are_no_compute_dtype_are_exercised(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, _ = _run(pytester, "broken_bf16_kv_truncates", "extended", "kvwrite")
    assert set(failed) == {"kvwrite-f32-kvbf16-h64-bs16-kvh2-strided"}, failed
    assert "not bit-exact copies of the input (cast to bfloat16)" in failed["kvwrite-f32-kvbf16-h64-bs16-kvh2-strided"]


# -- 2: shapes past the path switches --------------------------------------------------------------


def test_long_contexts_reach_split_k(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, _ = _run(pytester, "broken_split_k", "extended", "long or big-batch")
    assert set(failed) == {"attn-f32-h128-bs16-g4x2-long-decode", "attn-f32-h128-bs16-g4x2-long-prefill"}, failed
    assert "kv length" in failed["attn-f32-h128-bs16-g4x2-long-decode"]


def test_gemm_m_past_256_off_the_tiles(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, _ = _run(pytester, "broken_gemm_m_tail", "extended", "gemm")
    assert set(failed) == {
        "gemm-f32-257x576x576",
        "gemm-f32-300x1536x576-bias",
        "gemm-f32-300x576x577-bias",
        "gemm-f32-1000x576x197-bias",
    }, failed  # M = 2048, a multiple of every tile, passes
    assert all("worst at row" in m for m in failed.values())


# -- 6: copy-on-write ------------------------------------------------------------------------------


def test_copy_blocks_is_exercised_in_core(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, _ = _run(pytester, "broken_copy_blocks", "core", "copyblocks or attn-f32-h64-bs16-g2x2")
    assert set(failed) == {"copyblocks-f32-kvf32-h64-bs16-kvh2"}, failed
    assert "V of target blocks" in failed["copyblocks-f32-kvf32-h64-bs16-kvh2"]


# -- 10: determinism -------------------------------------------------------------------------------


def test_a_second_call_must_give_the_same_bits(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, result = _run(pytester, "broken_nondeterministic", "core", "attn")
    assert set(failed) == {
        "attn-f32-h64-bs16-g2x2-decode",
        "attn-f32-h128-bs16-g2x2-decode",
        "attn-f32-h64-bs16-g4x2-mixed",
        "attn-f32-h128-bs16-g4x2-mixed",
    }, failed
    assert all("not deterministic" in m and "'nondeterministic'" in m for m in failed.values()), failed
    assert _passed(result) >= 10  # one ulp is far inside every tolerance: the single-call cases pass


# -- 3: the perf tier checks what it times ---------------------------------------------------------


def test_perf_tier_checks_its_outputs(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, _ = _run(pytester, "broken_perf_gemm", "perf", "gemm")
    assert set(failed) == {"perf-gemm-m512"}, failed
    assert "relative error" in failed["perf-gemm-m512"]
    failed, _ = _run(pytester, "broken_perf_gemm", "extended", "gemm")
    assert not failed  # only the perf shape reaches the bf16 path


# -- 4: value regimes ------------------------------------------------------------------------------


def test_large_scores_need_the_running_maximum(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, _ = _run(pytester, "broken_softmax_no_max", "extended", "attn-f32-h64-bs16-g")
    assert set(failed) == {"attn-f32-h64-bs16-g4x2-mixed-vlarge", "attn-f32-h64-bs16-g4x2-decode-vlarge"}, failed
    assert all("NaN/Inf where the fp64 result is finite" in m for m in failed.values())


def test_the_softmax_scale_is_varied(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, _ = _run(pytester, "broken_ignores_scale", "extended", "attn-f32")
    assert set(failed) == {"attn-f32-h64-bs16-g2x2-prefill-vscale", "attn-f32-h64-bs16-g2x2-decode-vscale"}, failed


def test_soft_cap_logits_deep_in_saturation(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, result = _run(pytester, "broken_tanh_overflow", "extended", "cap")
    assert failed and all(case.endswith("-vadversarial") for case in failed), failed
    assert "attn-f32-h64-bs16-g2x2-decode-cap5-vadversarial" in failed
    assert _passed(result) >= 6  # soft-cap 2 and 30 in every batch kind pass


def test_rms_norm_far_from_rms_1(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, result = _run(pytester, "broken_rms_eps", "extended", "ops")
    assert {"ops-rms_norm-f32-x0.001"} <= set(failed) and all("x0.001" in c for c in failed), failed
    assert _passed(result) >= 8


# -- 5: features crossed with every batch kind and window alignment --------------------------------


def test_windows_aligned_with_the_block(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, _ = _run(pytester, "broken_window_aligned", "extended", "sw")
    assert failed and all(re.search(r"-sw(16|32)\b", c) for c in failed), failed
    assert {f"attn-f32-h64-bs16-g2x2-{k}-sw16" for k in ("prefill", "decode", "mixed", "chunked")} <= set(failed)


def test_soft_cap_in_pure_decode(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, _ = _run(pytester, "broken_cap_decode", "extended", "cap")
    assert "attn-f32-h64-bs16-g2x2-decode-cap2" in failed and "attn-f32-h128-bs16-g4x2-long-decode-cap30" in failed
    assert all("decode" in c for c in failed), failed


# -- 7: operand layouts varied one at a time --------------------------------------------------------


def test_key_and_value_layouts_vary_independently(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, result = _run(pytester, "broken_value_strides", "extended", "kvwrite")
    assert set(failed) == {
        "kvwrite-f32-h128-bs16-kvh3-kstrided",
        "kvwrite-f32-h128-bs16-kvh3-vstrided",
        "kvwrite-f32-h64-bs16-kvh5-vstrided",
    }, failed
    assert _passed(result) >= 4  # both contiguous, both views into one fused qkv


def test_rotary_on_a_strided_view(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, _ = _run(pytester, "broken_rotary_strides", "extended", "ops")
    assert set(failed) == {"ops-rotary-f32-rd64-strided", "ops-rotary-f32-rd32-strided"}, failed


# -- 8: engine models whose output depends on attention ---------------------------------------------

#: Suite 1.2's engine cases on the tiny Llama (random weights: it repeats its last prompt token).
OLD_ENGINE = "engine-llama"


@pytest.mark.parametrize(
    ("backend", "caught"),
    [
        ("broken_zero_attention", {"engine-induction-copy-vs-reference", "engine-induction-forks-and-prefix-hits"}),
        ("broken_no_causal_mask", {"engine-induction-copy-vs-reference", "engine-induction-forks-and-prefix-hits"}),
        ("broken_copy_blocks", {"engine-induction-forks-and-prefix-hits"}),
    ],
)
def test_engine_cases_need_attention_to_the_context(
    pytester: pytest.Pytester, paths_site: Path, backend: str, caught: set[str]
) -> None:
    """Suite 1.2's engine cases pass each of these; the induction model's do not."""
    failed, result = _run(pytester, backend, "extended", "induction")
    assert set(failed) == caught, failed
    old_failed, old = _run(pytester, backend, "extended", OLD_ENGINE)
    assert not old_failed and _passed(old) == 2, old_failed


def test_engine_window_one_key_short(pytester: pytest.Pytester, paths_site: Path) -> None:
    failed, _ = _run(pytester, "broken_window_one_short", "extended", "induction-sw")
    assert set(failed) == {"engine-induction-sw-copy-vs-reference", "engine-induction-sw-forks-and-prefix-hits"}, failed
    assert "logprobs differ" in failed["engine-induction-sw-copy-vs-reference"]  # and the greedy tokens at period 24
    old_failed, old = _run(pytester, "broken_window_one_short", "extended", OLD_ENGINE)
    assert not old_failed and _passed(old) == 2, old_failed


# -- 9: quantized rounding modelled exactly -----------------------------------------------------------


@pytest.mark.parametrize("backend", ["broken_truncates_activations", "broken_int8_per_64"])
def test_activation_rounding_off_by_a_little(pytester: pytest.Pytester, paths_site: Path, backend: str) -> None:
    """Fails the exact-rounding oracle (core, M > 1 included) and passes suite 1.2's worst-case allowance."""
    failed, _ = _run(pytester, backend, "core", "quant")
    core = {f"quant-{fmt}-f32-{m}x576x197-bias" for fmt in ("q4_1", "q8_0") for m in (1, 7, 37)}
    assert set(failed) == core, failed  # (extended: all 24 fp32 quantized cases fail too)
    assert all("closest activation rounding" in m for m in failed.values()), failed
    assert old_allowance_passes(backend)


def old_allowance_passes(backend: str) -> bool:
    """Every fp32 quantized case of this suite passes suite 1.2's check (fp64 product with the
    dequantized weight, the worst-case int8 allowance forgiven, the calibrated gates)."""
    import hashlib

    import plinth_broken_paths as mod
    import torch

    from plinth.platform.quant import dequantize
    from plinth.platform.reference import ReferenceGemm
    from plinth_conformance.coverage import all_quant_cases
    from plinth_conformance.quantized import activation_rounding_allowance, random_activations, random_weight
    from plinth_conformance.tolerance import compare

    def seed_of(case_id: str) -> int:  # case_seed as suite 1.4.0 drew it (see below)
        digest = hashlib.sha256(f"plinth-conformance 1.4.0 {case_id}".encode()).digest()
        return int.from_bytes(digest[:4], "little")

    cls = next(cls for cls in mod.BACKENDS if cls.name == backend)
    gemm, ref, caps = cls.gemm_cls(torch.float32), ReferenceGemm(torch.float32), cls().capabilities()
    for case in all_quant_cases(caps, "float32"):
        if case.skip or case.dtype != "float32":
            continue
        # pinned to suite 1.4.0's seeds, where this was shown: the worst-case allowance is a bound,
        # not a model, so under other draws int8 per 64 values may exceed it (1.5.0's q4_1 cases do)
        gen = torch.Generator().manual_seed(seed_of(case.id))
        weight = random_weight(case.fmt, case.n, case.k, gen)
        x = random_activations(case.m, case.k, torch.float32, gen)
        b = torch.randn(case.n, generator=gen) if case.bias else None
        out = gemm.linear(x, gemm.prepare_quantized(weight, b))
        w = dequantize(weight)
        gold = x.double() @ w.double().t() + (0 if b is None else b.double())
        verdict = compare(
            out, gold, ref.linear(x, ref.prepare(w, b)), case.k, allowance=activation_rounding_allowance(x, w)
        )
        if not verdict.ok:
            return False
    return True
