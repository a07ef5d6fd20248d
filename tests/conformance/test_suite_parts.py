"""Fast checks of the suite's parts: tolerances, seeds, case generation, NaN traps, matrix, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plinth.cli import main
from plinth.platform.backend import AttentionSpec, Capabilities
from plinth.platform.reference import ReferenceBackend
from plinth_conformance.cases import attention_cases, case_seed, gemm_cases, undeclared_cases
from plinth_conformance.matrix import render_matrix
from plinth_conformance.paged import build_batch, golden_attention
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
    assert "cpu: plinth-cpu 0.1.0 (plinth_cpu.plugin); hooks: plinth_register_backends; backends: cpu; API 1.0" in out
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
