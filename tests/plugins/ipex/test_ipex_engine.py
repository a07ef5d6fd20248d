"""The engine end to end with plinth-ipex's kernels: a tiny random Llama gives the plain cpu backend's
greedy tokens (chunked prefills, decodes and mixed steps). Skipped without IPEX (the main .venv)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("intel_extension_for_pytorch", reason="IPEX is installed only in the ipex lane (make test-ipex)")

from plinth_ipex.attention import IpexAttention  # noqa: E402
from plinth_ipex.choice import OPS_ENV  # noqa: E402
from plinth_ipex.gemm import IpexGemm  # noqa: E402

from plinth import LLM, SamplingParams  # noqa: E402
from plinth.platform.backend import AttentionSpec  # noqa: E402
from plinth_conformance.tiny_models import assert_same_generations, prompts, save_tiny_model  # noqa: E402

ENGINE: dict[str, Any] = dict(
    num_kv_blocks=64, block_size=16, max_model_len=256, max_num_batched_tokens=48, max_num_seqs=8, dtype="float32"
)
LOGPROB_TOL = 1e-4  # float32 on both sides


@pytest.mark.parametrize("ops", ["all", "attention/float32", "gemm/float32"])
def test_greedy_tokens_equal_the_plain_cpu_backend(ops: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save_tiny_model("llama", tmp_path / "llama")
    monkeypatch.setenv(OPS_ENV, "none")
    plain = LLM(model=str(folder), backend="cpu", **ENGINE)
    assert not isinstance(plain.engine.kernels.gemm, IpexGemm)
    monkeypatch.setenv(OPS_ENV, ops)
    from plinth.platform import host

    monkeypatch.setattr(host, "_default_host", None)  # the provider reads the setting when built
    ipex = LLM(model=str(folder), backend="cpu", **ENGINE)
    assert isinstance(ipex.engine.kernels.gemm, IpexGemm) == (ops != "attention/float32")
    spec = AttentionSpec(4, 2, 16, 16)  # any spec IPEX covers
    assert isinstance(ipex.engine.kernels.attention(spec), IpexAttention) == (ops != "gemm/float32")
    # lengths past one block, past the 48-token step budget (chunked), and a 1-token prompt
    batch = prompts(0, (1, 9, 17, 40, 70, 33))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    assert_same_generations(ipex.generate(batch, greedy), plain.generate(batch, greedy), LOGPROB_TOL)
