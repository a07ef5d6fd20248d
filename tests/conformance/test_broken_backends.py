"""The suite tests itself: each deliberately broken backend fails, each for the right reason, with a
message naming the case and the error, the case's seed, and a command that re-runs it alone."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from plinth.platform.backend import Capabilities, MoECapabilities
from plinth_conformance.cli import suite_args
from plinth_conformance.coverage import all_quant_cases
from plinth_conformance.moe import chosen_experts
from plinth_conformance.moe_cases import MoECase, moe_cases

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent
MODULE = "plinth_broken_backends"  # the name the copied module gets on sys.path


def _write_dist(root: Path) -> None:
    """A fake installed distribution with one ``plinth.backends`` entry point per broken backend."""
    shutil.copy(HERE / "broken_backends.py", root / f"{MODULE}.py")
    info = root / "plinth_broken-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plinth-broken\nVersion: 0.0.1\n")
    names = [
        "partial_block",
        "reads_past_end",
        "k_tail",
        "padding_slot",
        "lies_80",
        "raises_80",
        "accepts_anything",
        "declares_nothing",
        "spmd_without_steps",
        "one_device_for_every_rank",
        "stored_bf16_in_bf16",
        "q4_1_min",
        "nibble_order",
        "stale_residual",
        "heads_stride",
        "moe_renormalize",
        "moe_drops_expert",
        "moe_contiguous",
        "moe_accepts_anything",
    ]
    entries = [f"broken_{n} = {MODULE}:{n}" for n in names]
    correct = ("quant_ok", "quant_rounds_activations", "moe_ok", "moe_rounds_activations")
    entries += [f"{n} = {MODULE}:{n}" for n in correct]  # correct ones
    lines = "\n".join(entries)
    (info / "entry_points.txt").write_text(f"[plinth.backends]\n{lines}\n")


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The fake distribution on sys.path for this module's tests (removed afterwards)."""
    root = tmp_path_factory.mktemp("broken_site")
    _write_dist(root)
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    sys.modules.pop(MODULE, None)


def _run(pytester: pytest.Pytester, backend: str, tier: str, keyword: str | None) -> pytest.RunResult:
    return pytester.runpytest(*suite_args(backend, tier, keyword=keyword))


def _failures(result: pytest.RunResult) -> dict[str, str]:
    """Case id -> message of every failed case, from the suite's own end-of-run list."""
    out = {}
    for line in result.outlines:
        m = re.match(r"FAILED (?P<case>\S+) \(seed \d+\): (?P<msg>.*)", line)
        if m:
            out[m["case"]] = m["msg"]
    return out


def test_attention_ignoring_the_last_partial_block_fails(pytester: pytest.Pytester, broken_site: Path) -> None:
    result = _run(pytester, "broken_partial_block", "core", "attn or kvwrite")
    failed = _failures(result)
    assert failed and all(case.startswith("attn-") for case in failed), failed  # KV writes still pass
    msg = failed["attn-f32-h64-bs16-g2x2-decode"]
    assert "[attn-f32-h64-bs16-g2x2-decode]" in msg and "relative error" in msg
    result.stdout.fnmatch_lines(
        [
            "*worst at token*sequence*",
            "*seed: *",
            "*plinth conformance --backend broken_partial_block --tier extended -k '[[]attn-*]'*",
        ]
    )


def test_attention_reading_past_the_sequence_end_fails_on_nan_pages(
    pytester: pytest.Pytester, broken_site: Path
) -> None:
    failed = _failures(_run(pytester, "broken_reads_past_end", "core", "attn-f32-h64"))
    assert failed
    assert all("NaN/Inf where the fp64 result is finite" in m for m in failed.values()), failed


def test_gemm_dropping_the_k_tail_fails_only_unaligned_shapes(pytester: pytest.Pytester, broken_site: Path) -> None:
    result = _run(pytester, "broken_k_tail", "core", "gemm")
    failed = _failures(result)
    # K = 255 has a tail past the last multiple of 64; SmolLM2's K of 576 and 1536 do not
    assert set(failed) == {
        "gemm-f32-33x255x513-bias",
        "gemm-f32-33x255x513-bias-x-transposed",
        "gemm-f32-33x255x513-bias-x-strided",
        "gemm-f32-33x255x513-bias-w-transposed",
    }, failed
    assert all("relative error" in m and "worst at row" in m for m in failed.values())


def test_gemm_computing_stored_bf16_weights_in_bf16_fails(pytester: pytest.Pytester, broken_site: Path) -> None:
    """A GEMM taking bf16 weights as stored (API 1.14) owes the fp32 model's product: one that rounds
    the activations to bf16 fails the stored-dtype case; the reference backend (no stored dtypes)
    skips it with the reason."""
    result = _run(pytester, "broken_stored_bf16_in_bf16", "core", "stored")
    result.stdout.fnmatch_lines(["*[[]gemm-stored-bfloat16-in-float32-1x96x45[]]*relative error*"])
    assert result.ret != 0
    skipped = _run(pytester, "reference", "core", "stored")
    skipped.stdout.fnmatch_lines(["*1 skipped*"])
    assert skipped.ret == 0


def test_kv_write_ignoring_the_padding_sentinel_fails(pytester: pytest.Pytester, broken_site: Path) -> None:
    failed = _failures(_run(pytester, "broken_padding_slot", "core", "kvwrite or attn-f32-h64-bs16-g1x2"))
    assert set(failed) == {
        "kvwrite-f32-h64-bs16-kvh2",
        "kvwrite-f32-h128-bs16-kvh2",
        "kvwrite-f32-h128-bs16-kvh2-strided",
    }, failed
    assert all("slots it was not given were changed" in m and "last slot" in m for m in failed.values())


def test_declared_head_size_computed_wrong_fails(pytester: pytest.Pytester, broken_site: Path) -> None:
    failed = _failures(_run(pytester, "broken_lies_80", "extended", "attn and h80"))
    assert failed == {"attn-f32-h80-bs16-g4x2-mixed": failed["attn-f32-h80-bs16-g4x2-mixed"]}
    assert "relative error" in failed["attn-f32-h80-bs16-g4x2-mixed"]


def test_declared_head_size_raising_something_else_fails(pytester: pytest.Pytester, broken_site: Path) -> None:
    failed = _failures(_run(pytester, "broken_raises_80", "extended", "h80 or undeclared"))
    assert set(failed) == {"attn-f32-h80-bs16-g4x2-mixed", "kvwrite-f32-h80-bs16-kvh1"}, failed
    for case, message in failed.items():
        assert f"[{case}] attention_kernels() raised ValueError: head size 80 is not implemented" in message


def test_undeclared_cases_returning_numbers_fail(pytester: pytest.Pytester, broken_site: Path) -> None:
    failed = _failures(_run(pytester, "broken_accepts_anything", "core", "undeclared"))
    assert {
        "undeclared-head-size-80",
        "undeclared-block-size-3",
        "undeclared-dtype-f64",
        "undeclared-gemm-dtype-f64",
        "undeclared-sliding-window",
        "undeclared-logits-soft-cap",
    } <= set(failed)
    assert all("returned numbers instead of raising NotSupported" in m for m in failed.values()), failed


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("broken_spmd_without_steps", "*[[]spmd[]] declared without step buckets*"),
        (
            "broken_one_device_for_every_rank",
            "*[[]device-resource[]] 'GPU' declared (a device per rank)*both map to cpu*",
        ),
    ],
)
def test_scale_out_declarations_the_backend_cannot_keep_fail(
    pytester: pytest.Pytester, broken_site: Path, backend: str, message: str
) -> None:
    result = _run(pytester, backend, "core", "scale_out")
    result.stdout.fnmatch_lines([message])
    assert result.ret != 0


def test_declaring_nothing_fails_the_mandatory_profile(pytester: pytest.Pytester, broken_site: Path) -> None:
    result = _run(
        pytester, "broken_declares_nothing", "core", "mandatory or attn-f32-h64-bs16-g1x2-mixed or gemm-f32-1x"
    )
    result.stdout.fnmatch_lines(["*[[]mandatory-profile[]] not declared: dtype float32*head size 64*block size 16*"])
    failed = _failures(result)
    assert "the mandatory core profile needs this case" in failed["attn-f32-h64-bs16-g1x2-mixed"]
    assert "mandatory core profile needs GEMM in float32" in failed["gemm-f32-1x576x576-bias"]
    assert result.ret != 0


#: What the quantized test backends declare: the fp32 profile plus q4_1 and q8_0.
F32 = frozenset({"float32"})
QUANT_CAPS = Capabilities(F32, F32, frozenset({64, 128}), (16,), quant_formats=frozenset({"q4_1", "q8_0"}))


def _quant_ids(fmt: str) -> set[str]:
    return {c.id for c in all_quant_cases(QUANT_CAPS, "float32") if c.fmt == fmt}


@pytest.mark.parametrize("backend", ["broken_q4_1_min", "broken_nibble_order"])
def test_quantized_gemm_decoding_q4_1_wrong_fails_every_q4_1_case(
    pytester: pytest.Pytester, broken_site: Path, backend: str
) -> None:
    """Forgetting the q4_1 minimum, or reading the nibbles in the wrong order, matches no activation
    rounding the oracle models; the q8_0 cases of the same kernel pass."""
    result = _run(pytester, backend, "extended", "quant")
    failed = _failures(result)
    assert len(_quant_ids("q4_1")) == 12 and set(failed) == _quant_ids("q4_1"), failed
    for case, message in failed.items():
        assert f"[{case}] relative error beyond the " in message and "rounding-tie allowance" in message, message
        assert "closest activation rounding" in message, message
    result.stdout.fnmatch_lines(["*worst at row * (M=*, K=*, N=*, q4_1)*"])
    result.assert_outcomes(failed=12, passed=12)


@pytest.mark.parametrize("backend", ["quant_ok", "quant_rounds_activations"])
def test_correct_quantized_gemms_pass_with_or_without_activation_rounding(
    pytester: pytest.Pytester, broken_site: Path, backend: str
) -> None:
    """Dequantize + F.linear passes; so does llama.cpp's int8 rounding of activations."""
    result = _run(pytester, backend, "extended", "quant")
    assert result.ret == 0, "\n".join(result.outlines[-40:])
    result.assert_outcomes(passed=len(_quant_ids("q4_1") | _quant_ids("q8_0")))


def test_no_declared_quantized_format_skips_with_the_reason(pytester: pytest.Pytester, broken_site: Path) -> None:
    result = pytester.runpytest(*suite_args("broken_k_tail", "extended", keyword="quant", extra=["-rs"]))
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*no quantized GEMM format declared*"])


def test_add_rms_norm_returning_a_stale_residual_fails(pytester: pytest.Pytester, broken_site: Path) -> None:
    failed = _failures(_run(pytester, "broken_stale_residual", "core", "ops"))
    assert set(failed) == {"ops-add_rms_norm-f32"}, failed  # rms_norm, silu_and_mul, rotary still pass
    assert "[ops-add_rms_norm-f32:sum] relative error" in failed["ops-add_rms_norm-f32"]


def test_q_k_norm_ignoring_the_token_stride_and_the_erf_gelu_fail(pytester: pytest.Pytester, broken_site: Path) -> None:
    """Suite 1.6's cases for the API 1.8 ops: the strided per-head norm (a dense view passes) and the
    tanh GELU, whose erf twin is at most ~1e-3 off."""
    failed = _failures(_run(pytester, "broken_heads_stride", "extended", "ops-rms_norm_heads or ops-gelu"))
    expected = {"ops-rms_norm_heads-f32-strided", "ops-gelu_tanh_and_mul-f32", "ops-gelu_tanh_and_mul-f32-strided"}
    assert set(failed) == expected, failed
    assert "relative error" in failed["ops-gelu_tanh_and_mul-f32"]


def test_cli_exits_nonzero_and_the_printed_command_reruns_one_case(
    pytester: pytest.Pytester, broken_site: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(broken_site), os.environ.get("PYTHONPATH", "")])}
    cmd = [
        sys.executable,
        "-m",
        "plinth.cli",
        "conformance",
        "--backend",
        "broken_padding_slot",
        "--tier",
        "core",
        "-k",
        "kvwrite-f32-h64",
        "--report",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rerun = re.search(r"plinth conformance --backend broken_padding_slot --tier extended -k '(\[[^']+\])'", proc.stdout)
    assert rerun, proc.stdout[-3000:]
    assert (tmp_path / "junit.xml").is_file()
    cert = (tmp_path / "certificate.json").read_text()
    assert '"result": "failed"' in cert and "kvwrite-f32-h64-bs16-kvh2" in cert
    again = _run(pytester, "broken_padding_slot", "extended", rerun.group(1))
    again.assert_outcomes(failed=1)


#: What the fused-MoE test backends declare (``broken_backends._MoE``): fp32, both activations, q4_1/q8_0.
MOE_CAPS = Capabilities(
    F32,
    F32,
    frozenset({64, 128}),
    (16,),
    fused_moe=MoECapabilities(F32, frozenset({"q4_1", "q8_0"}), activations=frozenset({"silu", "gelu_tanh"})),
)


def _moe_ids(keep: Callable[[MoECase], bool] = lambda c: True) -> set[str]:
    return {c.id for c in moe_cases(MOE_CAPS, "float32") if keep(c)}


def _routes_to_last_expert(case: MoECase) -> bool:
    """Whether any token of ``case`` is routed to its last expert (the suite draws the routing first)."""
    chosen = chosen_experts(case, torch.Generator().manual_seed(case.seed))
    return bool((chosen == case.experts - 1).any())


@pytest.mark.parametrize("backend", ["moe_ok", "moe_rounds_activations"])
def test_correct_fused_moe_passes_with_or_without_activation_rounding(
    pytester: pytest.Pytester, broken_site: Path, backend: str
) -> None:
    """The grouped op passes every declared case; so does int8 rounding of a quantized expert's
    activations (both GEMMs), and the one undeclared dtype raises NotSupported."""
    result = _run(pytester, backend, "extended", "moe")
    assert result.ret == 0, "\n".join(result.outlines[-40:])
    result.assert_outcomes(passed=len(_moe_ids()) + 1)


def test_fused_moe_ignoring_renormalize_fails_exactly_the_unnormalised_cases(
    pytester: pytest.Pytester, broken_site: Path
) -> None:
    failed = _failures(_run(pytester, "broken_moe_renormalize", "extended", "moe"))
    want = _moe_ids(lambda c: not c.renormalize)
    assert len(want) >= 3 and set(failed) == want, failed
    assert all(f"[{case}] relative error" in m and "routed to experts" in m for case, m in failed.items()), failed


def test_fused_moe_dropping_an_expert_fails_every_case_that_routes_to_it(
    pytester: pytest.Pytester, broken_site: Path
) -> None:
    failed = _failures(_run(pytester, "broken_moe_drops_expert", "extended", "moe"))
    want = _moe_ids(_routes_to_last_expert)
    assert set(failed) == want and _moe_ids() - want, failed  # "idle-experts" and "one-expert" pass
    assert {c for c in want if "-q4_1" in c or "-q8_0" in c}, want  # quantized cases catch it too


def test_fused_moe_reading_x_as_contiguous_fails_the_guarded_cases_on_nan(
    pytester: pytest.Pytester, broken_site: Path
) -> None:
    failed = _failures(_run(pytester, "broken_moe_contiguous", "extended", "moe"))
    assert set(failed) == _moe_ids(lambda c: c.guarded), failed
    assert all("NaN/Inf where the fp64 result is finite" in m for m in failed.values()), failed


def test_fused_moe_for_an_undeclared_dtype_must_raise(pytester: pytest.Pytester, broken_site: Path) -> None:
    failed = _failures(_run(pytester, "broken_moe_accepts_anything", "core", "undeclared-moe"))
    assert set(failed) == {"undeclared-moe-dtype-f64"}, failed
    assert "returned numbers instead of raising NotSupported" in failed["undeclared-moe-dtype-f64"]
