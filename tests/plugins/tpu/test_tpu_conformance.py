"""The tpu backend's conformance lane: the core tier in Pallas' interpreter, certified as "interpreter"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plinth_conformance.cli import suite_args
from plinth_tpu.backend import INTERPRET_ENV

pytest_plugins = ["pytester"]


@pytest.mark.slow
def test_tpu_kernels_pass_the_core_tier_in_the_interpreter(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(INTERPRET_ENV, "1")
    result = pytester.runpytest(*suite_args("tpu", "core", report=tmp_path))
    assert result.ret == 0, "\n".join(result.outlines[-60:])
    cert = json.loads((tmp_path / "certificate.json").read_text())
    assert cert["result"] == "passed" and cert["tiers"]["core"]["passed"] >= 30
    assert cert["device"]["verified_on"] == "interpreter" and cert["device"]["emulation"] is True
    assert f"{INTERPRET_ENV}=1" in cert["device"]["interpreter_env"]
    assert cert["backend"]["name"] == "tpu" and cert["plugin"]["distribution"] == "plinth-tpu"
