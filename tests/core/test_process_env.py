"""plinth.process_env: the environment plugins ask for at ``import plinth`` (plugin API 1.15)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

from plinth import process_env


@dataclass
class _EntryPoint:
    name: str
    fn: Any

    def load(self) -> Any:
        return self.fn


def _boom() -> dict[str, str]:
    raise RuntimeError("no cpuinfo")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process_env, "applied", {})
    monkeypatch.setattr(process_env, "late", False)
    monkeypatch.delenv("PLINTH_PROCESS_ENV", raising=False)
    for name in ("PLINTH_TEST_A", "PLINTH_TEST_B"):
        monkeypatch.delenv(name, raising=False)


def test_apply_sets_what_is_unset_and_keeps_the_operators_value(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Unset variables are set; one the environment holds keeps its value; a failing plugin is
    logged by name and the others still apply."""
    monkeypatch.setenv("PLINTH_TEST_B", "mine")
    eps = [
        _EntryPoint("broken", _boom),
        _EntryPoint("acme", lambda: {"PLINTH_TEST_A": "PASSIVE", "PLINTH_TEST_B": "theirs"}),
    ]
    monkeypatch.setattr(process_env, "entry_points", lambda group: eps if group == process_env.GROUP else [])
    with caplog.at_level(logging.WARNING, logger="plinth.process_env"):
        process_env.apply()
    assert os.environ["PLINTH_TEST_A"] == "PASSIVE" and os.environ["PLINTH_TEST_B"] == "mine"
    assert process_env.applied == {"PLINTH_TEST_A": ("PASSIVE", "acme")}
    assert "broken failed: RuntimeError: no cpuinfo" in caplog.text
    assert process_env.report("PLINTH_TEST_B") == "PLINTH_TEST_B=mine (from the environment)"
    late = "torch" in sys.modules  # the test process has imported torch: too late for it
    assert process_env.report("PLINTH_TEST_A").startswith("PLINTH_TEST_A=PASSIVE (asked for by acme; set ")
    assert ("too late for this process" in process_env.report("PLINTH_TEST_A")) == late
    assert process_env.report("PLINTH_TEST_UNSET_X") == "PLINTH_TEST_UNSET_X unset"


def test_apply_can_be_turned_off(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLINTH_PROCESS_ENV", "0")
    monkeypatch.setattr(
        process_env, "entry_points", lambda group: [_EntryPoint("acme", lambda: {"PLINTH_TEST_A": "1"})]
    )
    process_env.apply()
    assert "PLINTH_TEST_A" not in os.environ and process_env.applied == {}


def test_import_plinth_sets_the_environment_before_torch() -> None:
    """In a fresh interpreter ``import plinth`` runs the installed plugins' entry points and
    imports no torch; what the cpu backend asks for is in the environment torch will read."""
    code = (
        "import sys, os, plinth\n"
        "from plinth import process_env\n"
        "print('torch' in sys.modules, process_env.late, sorted(process_env.applied))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "PLINTH_PROCESS_ENV")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    torch_imported, late, applied = out.split(" ", 2)
    assert torch_imported == "False" and late == "False"
    from plinth_cpu.preflight import build_check

    assert ("OMP_WAIT_POLICY" in applied) == (build_check()[0] is not None)
