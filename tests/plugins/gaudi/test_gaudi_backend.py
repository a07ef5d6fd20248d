"""The gaudi backend's probe, modes, runtime memory and what it declares through the contract."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from plinth_gaudi import backend as gaudi
from plinth_gaudi.backend import CONTIGUOUS_ENV, EMULATE_ENV, GaudiBackend, hpu_memory, probe_vendor

from plinth.platform.host import default_host


def test_without_the_vendor_stack_the_probe_scores_zero_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    probe = GaudiBackend().probe()
    assert probe.score == 0 and not probe.emulation
    assert probe.reasons == ("the Gaudi software stack (habana_frameworks.torch) is not installed",)


def test_plinth_backends_lists_gaudi_with_score_zero_and_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    status = {s.name: s for s in default_host().statuses()}["gaudi"]
    assert status.probe.score == 0 and "habana_frameworks.torch" in status.probe.reasons[0]


def _fake_vendor(root: Path, body: str) -> None:
    """A ``habana_frameworks.torch`` package on ``root`` whose ``hpu`` behaves as ``body`` says (what
    a machine with the stack but no device, or a broken stack, presents to the probe)."""
    pkg = root / "habana_frameworks" / "torch"
    pkg.mkdir(parents=True)
    (root / "habana_frameworks" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(body)


@pytest.mark.parametrize(
    "body,reason",
    [
        (
            "class hpu:\n    is_available = staticmethod(lambda: False)\n    device_count = staticmethod(lambda: 0)\n",
            "is installed, but no HPU is visible",
        ),
        ("raise OSError('libsynapse.so: cannot open shared object file')\n", "failed to initialise: OSError"),
    ],
)
def test_an_installed_stack_without_a_device_or_broken_is_score_zero_with_why(
    body: str, reason: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_vendor(tmp_path, body)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("habana_frameworks")]:
        monkeypatch.delitem(sys.modules, name)
    assert gaudi.vendor_present()
    probe = probe_vendor(True, emulate=False)
    assert probe.score == 0 and reason in probe.reasons[0]


def test_importing_the_plugin_never_imports_the_vendor_library() -> None:
    code = (
        "import sys, plinth_gaudi.plugin, plinth_gaudi.backend as b; b.GaudiBackend().probe(); "
        "print(any(m.startswith('habana_frameworks') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_emulation_is_score_five_on_the_cpu_and_labelled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EMULATE_ENV, "1")
    backend = GaudiBackend()
    probe = backend.probe()
    assert probe.score == 5 and probe.emulation and "not a hardware certification" in probe.reasons[1]
    services = backend.device_services()
    assert services.device.type == "cpu" and services.default_dtype() == "float32"
    free, total = services.memory_info()
    assert 0 < free <= total


def test_runtime_memory_is_read_from_the_runtime_and_never_zero() -> None:
    assert hpu_memory(SimpleNamespace(mem_get_info=lambda: (30 << 30, 96 << 30))) == (30 << 30, 96 << 30)
    stats = SimpleNamespace(memory_stats=lambda: {"Limit": 96 << 30, "InUse": 10 << 30})
    assert hpu_memory(stats) == (86 << 30, 96 << 30)
    with pytest.raises(RuntimeError, match="reports 0 bytes of device memory"):
        hpu_memory(SimpleNamespace(memory_stats=lambda: {}))


def test_it_declares_unmixed_steps_block_128_hccl_and_contiguous_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONTIGUOUS_ENV, raising=False)
    caps = GaudiBackend().capabilities()
    assert not caps.mixed_batches and caps.preferred_block_size == 128 and caps.communicator == "hccl"
    assert caps.block_placement == "any" and caps.kv_cache_layout.dims[0] == "kv"  # separate K and V
    monkeypatch.setenv(CONTIGUOUS_ENV, "1")
    assert GaudiBackend().capabilities().block_placement == "contiguous"


def test_buckets_are_separate_sets_holding_the_engine_maxima() -> None:
    b = GaudiBackend().step_buckets(256, 64, 4)
    assert b.decode is not None and b.decode.tokens == b.decode.seqs == (1, 2, 4, 8, 16, 32, 64)
    assert b.tokens == (16, 32, 64, 128, 256) and b.flat_blocks[-1] == 256 and b.decode.flat_blocks[-1] == 256
    shapes = b.shapes()
    assert all(s.tokens == s.seqs for s in shapes if s.decode) and any(not s.decode for s in shapes)
