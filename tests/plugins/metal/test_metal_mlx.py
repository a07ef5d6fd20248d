"""The optional MLX provider under ``mlx[cpu]``: its kernels against the reference, its registration,
and the engine end to end with it chosen. Skipped where MLX is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from plinth_metal import plugin
from plinth_metal.backend import EMULATE_ENV, MetalBackend
from plinth_metal.mlx_provider import MLX_ENV, MlxAttention, MlxGemm, MlxProvider

from plinth.platform.backend import AttentionSpec, KVCacheLayout
from plinth.platform.reference import ReferenceGemm

pytest_plugins = ["pytester"]

pytest.importorskip("mlx.core", reason="the MLX provider's tests need mlx (pip install 'mlx[cpu]')")

from test_metal_attention import SCALE, make_batch  # noqa: E402  (the same hostile batches)

from plinth.platform.reference import reference_paged_attention  # noqa: E402


def check_mlx(cases: list[tuple[int, int]], atol: float = 2e-5, **kw: object) -> None:
    batch = make_batch(cases, **kw)  # type: ignore[arg-type]
    out = MlxAttention(batch.spec, KVCacheLayout()).forward(batch.query, batch.kv_cache, batch.meta, SCALE)
    want = reference_paged_attention(
        batch.query.float(),
        batch.kv_cache[0].float(),
        batch.kv_cache[1].float(),
        batch.meta,
        SCALE,
        sliding_window=batch.spec.sliding_window,
        logits_soft_cap=batch.spec.logits_soft_cap,
    )
    assert torch.isfinite(out).all() and out.dtype == batch.query.dtype
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)


@pytest.mark.parametrize(
    "cases",
    [[(1, 1), (1, 17), (1, 100)], [(23, 23), (64, 64)], [(1, 31), (20, 20), (7, 50), (1, 3)]],
    ids=["decode", "prefill", "mixed"],
)
def test_mlx_attention_matches_the_reference(cases: list[tuple[int, int]]) -> None:
    check_mlx(cases)


def test_mlx_attention_gqa_window_soft_cap() -> None:
    check_mlx([(1, 37), (19, 19), (4, 44)], num_heads=12, num_kv_heads=4)
    check_mlx([(1, 70), (40, 40), (9, 61)], sliding_window=8)
    check_mlx([(1, 70), (25, 25), (6, 38)], logits_soft_cap=0.5, sliding_window=16)


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_mlx_attention_half_dtypes(dtype: torch.dtype, atol: float) -> None:
    check_mlx([(1, 33), (12, 12), (3, 47)], atol=atol, dtype=dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_mlx_gemm_matches_the_reference(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen), torch.randn(7, 64, generator=gen)
    ref = ReferenceGemm(torch.float32)
    want = ref.linear(x, ref.prepare(w, b))
    mine = MlxGemm(dtype)
    got = mine.linear(x.to(dtype), mine.prepare(w, b))
    assert got.dtype == dtype and got.shape == (7, 96)
    torch.testing.assert_close(got.float(), want, atol=tol * 8, rtol=tol)


def test_the_provider_is_offered_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MLX_ENV, raising=False)
    assert plugin.plinth_register_kernels("metal") == []
    monkeypatch.setenv(MLX_ENV, "1")
    assert plugin.plinth_register_kernels("cpu") == []
    [provider] = plugin.plinth_register_kernels("metal")
    assert isinstance(provider, MlxProvider) and provider.priority > 0
    assert provider.attention_kernels(AttentionSpec(4, 2, 64, 16), KVCacheLayout()) is not None
    assert provider.gemm_kernels("float64") is None  # not an MLX dtype: the backend's own GEMM


def test_the_plugin_imports_without_mlx() -> None:
    code = (
        "import sys; sys.modules['mlx'] = None; sys.modules['mlx.core'] = None\n"  # import mlx now fails
        "import plinth_metal.plugin as p; print(p.plinth_register_backends()[0].name)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "metal"


@pytest.mark.slow
def test_the_engine_picks_mlx_and_matches_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_metal_engine import ENGINE, _compare

    from plinth import LLM, SamplingParams
    from plinth_conformance.tiny_models import prompts, save_tiny_model

    monkeypatch.setenv(EMULATE_ENV, "1")
    monkeypatch.setenv(MLX_ENV, "1")
    folder = save_tiny_model("qwen2", tmp_path / "qwen2")
    llm = LLM(model=str(folder), backend="metal", **ENGINE)
    assert isinstance(llm.engine.backend, MetalBackend) and isinstance(llm.engine.kernels.gemm, MlxGemm)
    assert isinstance(llm.engine.kernels.attention(AttentionSpec(4, 2, 64, 16)), MlxAttention)
    ref = LLM(model=str(folder), backend="reference", **ENGINE)
    batch = prompts(1, (1, 9, 40, 70))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    _compare(llm.generate(batch, params), ref.generate(batch, params))


@pytest.mark.slow
def test_the_mlx_provider_passes_the_core_tier_in_emulation(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    from importlib.metadata import version

    from plinth_conformance.cli import suite_args

    monkeypatch.setenv(EMULATE_ENV, "1")
    # in a subprocess: the shim patches the backend class, which must not leak into this session
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    note = (
        f"kernels: the MLX provider (mlx {version('mlx')}, CPU build) through tests/plugins/metal/mlx_conformance_shim"
    )
    args = suite_args("metal", "core", report=tmp_path, note=note, extra=["-p", "mlx_conformance_shim", "-s"])
    result = pytester.runpytest_subprocess(*args)
    assert result.ret == 0, "\n".join(result.outlines[-60:])
    assert any("kernels made: ['MlxAttention', 'MlxGemm']" in line for line in result.outlines), result.outlines[-5:]
    cert = json.loads((tmp_path / "certificate.json").read_text())
    assert cert["result"] == "passed" and cert["tiers"]["core"]["passed"] >= 30
    assert cert["device"]["verified_on"] == "emulation" and "MLX provider" in cert["note"]
