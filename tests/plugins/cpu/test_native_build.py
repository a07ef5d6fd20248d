"""The native library is built at install or on the first kernel request, never during discovery.

``plinth_register_backends`` must not touch hardware or compile (its hook docstring says so): on a
fresh cache the build took 6.7 s of plain discovery. Each case runs in a fresh interpreter with
``PLINTH_CACHE_DIR`` pointed at a directory of the test's choosing, so nothing cached in this
process (the library is loaded once per process) hides a build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plinth_cpu.native import build_check, choose_variant, emulating, library_path, native, native_status

#: Discovery and every backend's probe, then what the cache directory holds and what was loaded.
DISCOVER = """
import json, os, sys
from pathlib import Path
from plinth.platform.host import PluginHost
statuses = {s.name: s for s in PluginHost().statuses()}  # discovery, then every probe
from plinth_cpu import native
report = {
    "files": sorted(str(p) for p in Path(os.environ["PLINTH_CACHE_DIR"]).rglob("*") if p.is_file()),
    "loaded": native.native_loaded(),
    "reasons": list(statuses["cpu"].reasons),
}
if sys.argv[1:] == ["kernels"]:
    statuses["cpu"].backend.gemm_kernels("float32")  # the first kernel request builds
    report["after_kernels"] = native.native_status()
    report["files_after"] = sorted(str(p) for p in Path(os.environ["PLINTH_CACHE_DIR"]).rglob("*") if p.is_file())
print(json.dumps(report))
"""


def _discover(cache: Path, *args: str) -> dict:
    env = {**os.environ, "PLINTH_CACHE_DIR": str(cache)}
    proc = subprocess.run(
        [sys.executable, "-c", DISCOVER, *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_discovery_and_probe_compile_nothing_and_say_so(tmp_path: Path) -> None:
    """Empty cache: discovery and the probes leave it empty and load nothing; the probe says the
    kernels are not built yet (where they could be), or why they cannot run here."""
    report = _discover(tmp_path)
    assert report["files"] == [] and report["loaded"] is False
    native_line = [r for r in report["reasons"] if r.startswith("native kernels")]
    assert len(native_line) == 1, report["reasons"]
    compiler, why_not = build_check()
    if compiler is None:
        assert native_line[0] == why_not
    else:
        assert "not built yet: compiled on first kernel request" in native_line[0]


def test_probe_reports_a_built_library_without_loading_it() -> None:
    """With the library in the cache (this process built or found it), a fresh discovery reports it
    as built, at its path, and still loads nothing."""
    kernels = native()
    if kernels is None:
        pytest.skip(native_status())
    report = _discover(kernels.path.parents[2])  # <cache>/cpu-kernels/<key>/libplinth_cpu.so
    assert report["loaded"] is False
    assert any(f"built ({kernels.path})" in r for r in report["reasons"]), report["reasons"]


@pytest.mark.slow(reason="compiles the kernel library from scratch (~7 s on the dev VM)")
def test_first_kernel_request_builds(tmp_path: Path) -> None:
    """The first kernel request compiles into the (empty) cache, and the status then says the
    kernels run."""
    if build_check()[0] is None:
        pytest.skip(build_check()[1])
    if emulating():
        pytest.skip("PLINTH_CPU_EMULATE=1: the lanes without it compile the real builds from scratch")
    report = _discover(tmp_path, "kernels")
    assert report["files"] == []
    compiler, variant = build_check()[0], choose_variant()[0]  # only the build this CPU loads is compiled
    assert compiler is not None
    assert [Path(f).name for f in report["files_after"]] == [library_path(compiler, variant).name]
    assert report["after_kernels"].startswith(f"native kernels: {variant.label}")


def test_process_env_asks_for_passive_openmp_where_the_kernels_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``plinth.process_env`` entry point (plugin API 1.15) asks for OMP_WAIT_POLICY=PASSIVE
    only where the native kernels can run (without them every op is torch's, which spinning helps)."""
    from importlib.metadata import entry_points

    from plinth_cpu import preflight

    (ep,) = [e for e in entry_points(group="plinth.process_env") if e.name == "cpu"]
    assert ep.value == "plinth_cpu.preflight:process_env"
    expected = {"OMP_WAIT_POLICY": "PASSIVE"} if build_check()[0] is not None else {}
    assert ep.load()() == expected
    monkeypatch.setenv("PLINTH_CPU_NATIVE", "0")
    assert preflight.process_env() == {}


def test_preflight_imports_no_torch() -> None:
    """The entry point's module (and the package's ``__init__``) load without torch."""
    code = "import sys, plinth_cpu.preflight; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )
