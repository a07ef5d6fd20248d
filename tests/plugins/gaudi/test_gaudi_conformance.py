"""The gaudi backend's conformance lane: the core tier on the CPU device, certified as "emulation"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plinth_gaudi.backend import EMULATE_ENV

from plinth_conformance.cli import suite_args

pytest_plugins = ["pytester"]


@pytest.mark.slow
def test_gaudi_kernels_pass_the_core_tier_in_emulation(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(EMULATE_ENV, "1")
    result = pytester.runpytest(*suite_args("gaudi", "core", report=tmp_path))
    assert result.ret == 0, "\n".join(result.outlines[-60:])
    cert = json.loads((tmp_path / "certificate.json").read_text())
    assert cert["result"] == "passed" and cert["tiers"]["core"]["passed"] >= 30
    assert cert["device"]["verified_on"] == "emulation" and cert["device"]["emulation"] is True
    assert not cert["device"]["interpreter"]
    assert cert["backend"]["name"] == "gaudi" and cert["plugin"]["distribution"] == "plinth-gaudi"
