"""The tpu backend's conformance lane: the core tier in Pallas' interpreter, certified as "interpreter".

The tier's one engine case (the induction model generating through the engine) is left out here: in the
interpreter it took 62 of the tier's 82 s on an Intel Xeon (about 120 s on a Zen 1, where CI has a
45-minute budget), and ``test_tpu_backend.py`` already runs the tpu engine end to end against the
reference backend (Llama and Qwen2, compiled steps, a 64-request workload). The committed certificate
(``docs/certificates/tpu.json``) is made with the whole tier."""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree

import pytest
from plinth_tpu.backend import INTERPRET_ENV

from plinth_conformance.cli import suite_args

pytest_plugins = ["pytester"]

#: The cases this lane runs (``-k``): every core case but the engine's.
KERNEL_CASES = "not test_engine"


@pytest.mark.slow
def test_tpu_kernels_pass_the_core_tier_in_the_interpreter(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(INTERPRET_ENV, "1")
    result = pytester.runpytest(*suite_args("tpu", "core", report=tmp_path, keyword=KERNEL_CASES))
    assert result.ret == 0, "\n".join(result.outlines[-60:])
    ran = [case.get("name", "") for case in ElementTree.parse(tmp_path / "junit.xml").iter("testcase")]
    assert ran and not [name for name in ran if name.startswith("test_engine")]
    assert any(name.startswith("test_paged_attention") for name in ran)
    cert = json.loads((tmp_path / "certificate.json").read_text())
    assert cert["result"] == "passed" and cert["tiers"]["core"]["passed"] >= 30
    assert cert["device"]["verified_on"] == "interpreter" and cert["device"]["emulation"] is True
    assert f"{INTERPRET_ENV}=1" in cert["device"]["interpreter_env"]
    assert cert["backend"]["name"] == "tpu" and cert["plugin"]["distribution"] == "plinth-tpu"
