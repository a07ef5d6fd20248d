"""Fast checks of the suite's parts: tolerances, seeds, case generation, NaN traps, matrix, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plinth.cli import main
from plinth.platform.backend import AttentionSpec, Capabilities
from plinth.platform.quant import dequantize
from plinth.platform.reference import ReferenceBackend
from plinth_conformance.cases import attention_cases, case_seed, gemm_cases, ops_cases, quant_cases, undeclared_cases
from plinth_conformance.matrix import render_matrix
from plinth_conformance.paged import build_batch, golden_attention
from plinth_conformance.quantized import (
    activation_rounding_allowance,
    random_activations,
    random_weight,
    round_activations,
    tie_allowance,
)
from plinth_conformance.tolerance import bits, compare

REPO = Path(__file__).resolve().parents[2]
NOTHING = Capabilities(frozenset(), frozenset(), frozenset(), ())


def test_compare_passes_an_honest_result_and_names_each_failed_gate() -> None:
    gold = torch.randn(64, 32, dtype=torch.float64)
    naive = gold.float()
    assert compare(naive, gold, naive, reduction=32).ok
    wrong = naive.clone()
    wrong[3, 5] += 1.0  # one bad element: the max-error gate catches it
    verdict = compare(wrong, gold, naive, reduction=32)
    assert not verdict.ok and "max scaled error" in verdict.message("c") and verdict.worst_index == 3 * 32 + 5
    nan = naive.clone()
    nan[0, 0] = float("nan")
    assert "NaN/Inf where the fp64 result is finite" in compare(nan, gold, naive, reduction=32).message("c")


def test_thresholds_scale_with_the_naive_error_of_the_dtype() -> None:
    gold = torch.randn(256, 64, dtype=torch.float64)
    f32 = compare(gold.float(), gold, gold.float(), reduction=64).metrics["tol_rel"]
    bf16 = compare(gold.bfloat16(), gold, gold.bfloat16(), reduction=64).metrics["tol_rel"]
    assert 1e-7 < f32 < 1e-5 and 1e-3 < bf16 < 5e-2


def test_seeds_are_stable_and_distinct_per_case() -> None:
    assert case_seed("attn-f32-h64-bs16-g1x2-mixed") == case_seed("attn-f32-h64-bs16-g1x2-mixed")
    assert case_seed("attn-f32-h64-bs16-g1x2-mixed") != case_seed("attn-f32-h64-bs16-g2x2-mixed")


def test_declaring_nothing_still_generates_the_mandatory_profile() -> None:
    core = {c.id for c in attention_cases(NOTHING, "float32") if c.tier == "core"}
    assert "attn-f32-h64-bs16-g8x2-mixed" in core and "attn-f32-h128-bs16-g1x2-mixed" in core
    assert {c.tier for c in attention_cases(NOTHING, "float32")} == {"core"}
    assert any(c.id == "gemm-f32-33x255x513-bias-x-strided" for c in gemm_cases(NOTHING, "float32"))


def test_every_declared_axis_is_swept_in_extended() -> None:
    caps = ReferenceBackend().capabilities()
    ids = {c.id for c in attention_cases(caps, "float32")}
    for head in (64, 80, 96, 128, 256):
        assert f"attn-f32-h{head}-bs16-g4x2-mixed" in ids
    for group in (1, 2, 4, 5, 8):
        assert f"attn-f32-h128-bs16-g{group}x2-decode" in ids
    assert "attn-f32-h64-bs256-g2x2-shared" in ids and "attn-f32-h64-bs1-g2x2-chunked" in ids
    assert any("-sw" in i for i in ids) and any("-cap" in i for i in ids)
    undeclared = {c.id for c in undeclared_cases(caps, "float32")}
    assert "undeclared-head-size-513" in undeclared and "undeclared-dtype-bf16" in undeclared


def test_quantized_cases_follow_the_declared_formats() -> None:
    f32 = frozenset({"float32", "bfloat16"})
    caps = Capabilities(f32, f32, frozenset({64, 128}), (16,), quant_formats=frozenset({"q4_1", "q8_0", "q5_k"}))
    cases = quant_cases(caps, "float32")
    real = [c for c in cases if c.skip is None]
    assert {c.fmt for c in real} == {"q4_1", "q8_0"}
    assert [c.id for c in cases if c.skip] == ["quant-q5_k-unknown"]  # listed and skipped, with the reason
    core = {c.id for c in real if c.tier == "core"}
    assert core == {f"quant-{f}-f32-{m}x576x197-bias" for f in ("q4_1", "q8_0") for m in (1, 7, 37)}  # M > 1 too
    assert {c.m for c in real} >= {1, 5, 17, 33} and all(c.k % 32 == 0 and c.n % 8 for c in real)
    assert {c.bias for c in real} == {True, False} and "quant-q4_1-bf16-5x576x197-bias" in {c.id for c in real}
    (none,) = quant_cases(NOTHING, "float32")
    assert none.id == "quant-none-declared" and "no quantized GEMM format declared" in (none.skip or "")
    assert "ops-add_rms_norm-f32" in {c.id for c in ops_cases(NOTHING) if c.tier == "core"}


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_random_blocks_are_finite_and_use_the_whole_format(fmt: str) -> None:
    w = random_weight(fmt, 7, 64, torch.Generator().manual_seed(1))
    values = dequantize(w)
    assert values.isfinite().all() and values.abs().max() > 0
    if fmt == "q4_1":
        d = w.blocks.reshape(-1, 20)[:, :2].contiguous().view(torch.float16).float()
        m = w.blocks.reshape(-1, 20)[:, 2:4].contiguous().view(torch.float16).float()
        q = (values.reshape(-1, 32) - m) / d
        assert (d > 0).all() and (m < 0).any() and (m > 0).any()
        assert torch.allclose(q, q.round(), atol=1e-3) and q.round().min() == 0 and q.round().max() == 15


@pytest.mark.parametrize("levels, passes", [(127, True), (15, False), (7, False)])
def test_the_allowance_admits_int8_activation_rounding_and_not_coarser(levels: int, passes: bool) -> None:
    """llama.cpp's int8-per-32 rounding (127 levels) stays inside; 4- and 5-bit rounding does not."""
    gen = torch.Generator().manual_seed(2)
    w = dequantize(random_weight("q4_1", 77, 576, gen))
    x = random_activations(17, 576, torch.float32, gen)
    xb = x.reshape(17, -1, 32)
    step = xb.abs().amax(-1, keepdim=True) / levels
    rounded = (torch.where(step > 0, xb / step, torch.zeros_like(xb)).round() * step).reshape(17, 576)
    gold = x.double() @ w.double().t()
    allowance = activation_rounding_allowance(x, w)
    verdict = compare(rounded @ w.t(), gold, x @ w.t(), 576, allowance=allowance, allowance_name="rounding allowance")
    assert verdict.ok is passes, verdict.metrics
    assert compare(x @ w.t(), gold, x @ w.t(), 576, allowance=allowance).metrics["allowance_used"] < 1e-3
    if not passes:
        assert "beyond the rounding allowance" in verdict.message("c")


def test_unused_pages_and_padded_table_entries_hold_nan() -> None:
    spec = AttentionSpec(4, 2, 64, 16)
    batch = build_batch(spec, "mixed", torch.Generator().manual_seed(0))
    owned = {p for pages in batch.pages for p in pages}
    table = batch.meta.block_tables
    for i, pages in enumerate(batch.pages):
        assert table[i, : len(pages)].tolist() == pages
        assert not owned & set(table[i, len(pages) :].tolist())  # padding points at unowned (NaN) pages
    assert sorted(owned) != list(range(len(owned)))  # pages are scattered, not contiguous
    assert batch.query_guard[0].isnan().all() and batch.query_guard[-1].isnan().all()
    assert golden_attention(batch).isfinite().all()


def test_bits_compares_nan_payloads() -> None:
    a = torch.full((4,), float("nan"))
    assert torch.equal(bits(a), bits(a.clone()))


def test_backends_verbose_lists_plugins_versions_hooks_and_api(capsys: pytest.CaptureFixture[str]) -> None:
    main(["backends", "--verbose"])
    out = capsys.readouterr().out
    from plinth_cpu import CpuBackend

    api = ".".join(map(str, CpuBackend.api_version))  # the version the backend declares, not a copy of it
    cpu = f"cpu: plinth-cpu 0.1.0 (plinth_cpu.plugin); hooks: plinth_register_backends; backends: cpu; API {api}"
    assert cpu in out
    assert "reference: plinth 0.1.0 (plinth.platform.reference); hooks: plinth_register_backends" in out


def test_conformance_without_a_backend_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance"]) == 2
    assert "--backend NAME is required" in capsys.readouterr().out


def test_committed_support_matrix_is_generated_from_the_committed_certificates(tmp_path: Path) -> None:
    out = tmp_path / "matrix.md"
    assert main(["conformance", "--matrix", "--certs", str(REPO / "docs/certificates"), "--out", str(out)]) == 0
    assert out.read_text() == (REPO / "docs/support-matrix.md").read_text()
    assert "| cpu " in out.read_text() and "| reference " in out.read_text()


def test_matrix_marks_emulation_and_failures() -> None:
    cert = json.loads((REPO / "docs/certificates/cpu.json").read_text())
    cert["backend"]["name"] = "gaudi"
    cert["device"]["verified_on"] = "emulation"
    cert["tiers"]["extended"]["status"] = "failed"
    page = render_matrix([cert])
    assert "**emulation**" in page and "pass / **FAIL** /" in page


def test_matrix_shows_the_fused_moe_op_as_certified() -> None:
    cert = json.loads((REPO / "docs/certificates/cpu.json").read_text())
    moe = cert["capabilities"]["fused_moe"]
    assert moe is not None and "q8_0" in moe["quant_formats"]  # what the cpu backend declares
    row = next(line for line in render_matrix([cert]).splitlines() if line.startswith("| cpu "))
    assert "| bf16, fp16, fp32, fp64; q4_1, q8_0 |" in row
    cert["capabilities"]["fused_moe"] = None
    assert "| - |" in render_matrix([cert])
    del cert["capabilities"]["fused_moe"]  # a certificate from before plugin API 1.8
    assert "| not recorded |" in render_matrix([cert])


def test_every_declared_value_and_path_class_is_generated() -> None:
    """Issue 17's rule: each declared value at least once (a KV dtype that is no compute dtype, every
    head size of a wide declaration), GQA groups above 8, odd KV-head counts, the long paths."""
    from plinth_conformance import coverage

    caps = Capabilities(
        frozenset({"float32"}),
        frozenset({"float32", "bfloat16"}),
        frozenset(range(16, 513, 8)),
        (8, 16, 64),
        features=frozenset({"sliding_window", "logits_soft_cap"}),
    )
    generated = (
        coverage.all_attention_cases(caps, "float32")
        + coverage.head_sweep_cases(caps, "float32")
        + coverage.all_gemm_cases(caps, "float32")
        + coverage.copy_blocks_cases(caps)
    )
    cov = coverage.covered(generated, caps)
    assert cov["declared_not_exercised"] == {}, cov["declared_not_exercised"]
    assert "float32/bfloat16" in cov["dtype_pairs"] and {9, 12, 16} <= set(cov["gqa_groups"])
    assert {3, 5} <= set(cov["kv_heads"]) and {16, 32, 19, 1} <= set(cov["sliding_windows"])
    paths = cov["path_classes"]
    for tag in ("attention-long-decode", "attention-big-batch", "copy-blocks", "window-block-aligned", "determinism"):
        assert paths.get(tag, 0) >= 1, (tag, paths)
    assert any(s.startswith("1000x") for s in cov["gemm_shapes"])
    bare = coverage.covered([], caps)  # nothing passed: everything declared is listed as not exercised
    assert bare["declared_not_exercised"]["head_sizes"] == sorted(caps.head_sizes)


def test_the_int8_oracle_is_the_cpu_kernels_rounding() -> None:
    """``round_activations(x, "int8")`` gives the values the cpu backend's int8 GEMMs multiply, bit
    for bit except where the tie allowance covers a rounding either way (suite 1.3's exact oracle)."""
    native = pytest.importorskip("plinth_cpu.native").native()
    if native is None:
        pytest.skip("the cpu backend's native kernels are not built")
    gen = torch.Generator().manual_seed(3)
    x = random_activations(37, 576, torch.float32, gen)
    mine, theirs = round_activations(x, "int8"), native.round_trip_q8(x.contiguous())
    differ = mine != theirs
    w = torch.ones(1, 576)
    ties = tie_allowance(x, w, "int8")  # [37, 1]: sum of one quantum over each row's near-ties
    assert int(differ.sum()) <= 2, int(differ.sum())
    for row in differ.any(1).nonzero().flatten().tolist():
        assert float(ties[row, 0]) > 0, row  # every difference sits on a near-tie the allowance covers
    assert float(ties.sum()) < 1e-3 * float(x.abs().sum())  # near-ties are rare


@pytest.mark.parametrize("scheme", ["none", "int16", "int8", "int8-f16-scale"])
def test_round_activations_stays_on_its_grid(scheme: str) -> None:
    gen = torch.Generator().manual_seed(4)
    x = random_activations(5, 256, torch.float32, gen)
    r = round_activations(x, scheme)
    assert r.shape == x.shape and bool(r[0, 32:64].eq(0).all())  # the all-zero block stays 0, no NaN
    err = (r - x).reshape(5, -1, 32).abs().amax(-1) / x.reshape(5, -1, 32).abs().amax(-1).clamp_min(1e-30)
    bound = {"none": 0.0, "int16": 0.5 / 32767, "int8": 0.5 / 127, "int8-f16-scale": 0.5 / 127 + 1e-3}[scheme]
    assert float(err.max()) <= bound * (1 + 1e-5), float(err.max())
    with pytest.raises(ValueError, match="unknown activation rounding 'int4'"):
        round_activations(x, "int4")


def test_induction_prompts_and_their_continuation() -> None:
    from plinth_conformance import induction

    prompt = induction.cyclic_prompt(7, 5, 12)
    cycle = prompt[1:6]
    assert len(prompt) == 12 and len(set(cycle)) == 5 and prompt[0] not in cycle
    assert prompt[1:] == (cycle * 3)[:11]
    assert induction.continuation(prompt, 5, 7) == (cycle * 4)[11 : 11 + 7]
    assert all(induction.FIRST_CODED <= t < induction.FIRST_CODED + induction.NUM_CODED for t in prompt)
    with pytest.raises(ValueError, match="period must be in 1..63"):
        induction.cyclic_prompt(0, 64, 100)
    codes = induction.codes()
    gram = codes @ codes.t()
    assert set(gram.unique().tolist()) == {-32.0, 0.0, 32.0}  # orthogonal or opposite
    # layer 1's previous-token head: the previous key beats every other one by PREV_MARGIN nats
    assert induction.prev_token_margin() > 1.5


def test_matrix_shows_the_kv_cache_dtypes_a_certificate_declares() -> None:
    cert = json.loads((REPO / "docs/certificates/cpu.json").read_text())
    assert "float8_e4m3fn" in cert["capabilities"]["kv_cache_dtypes"]
    head, _, row = render_matrix([cert]).split("\n|")[1:4]
    column = head.split(" | ").index("KV cache dtypes")
    assert "fp8 e4m3" in row.split(" | ")[column]
    cert["capabilities"]["kv_cache_dtypes"] = ["bfloat16"]
    assert render_matrix([cert]).split("\n|")[3].split(" | ")[column] == "bf16"
    del cert["capabilities"]["kv_cache_dtypes"]  # a certificate from before the capability
    assert render_matrix([cert]).split("\n|")[3].split(" | ")[column] == "not recorded"
