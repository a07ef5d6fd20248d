"""The ROCm backend: registration, probes with and without hardware, AMD tuning, interpreter mode.

The kernels are plinth-triton-kernels' (tested in tests/plugins/triton); here one attention call
through the ROCm backend object checks the wiring.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from plinth_rocm import RocmBackend, plugin
from plinth_rocm.backend import gfx_arch
from plinth_triton import runtime
from plinth_triton.backend import HARDWARE_SCORE, INTERPRETER_DEVICE, INTERPRETER_SCORE
from triton_batches import SCALE, paged_batch

from plinth.platform.backend import AttentionSpec

ROOT = Path(__file__).parents[3]


@pytest.fixture
def hardware_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """No interpreter request in the environment."""
    monkeypatch.delenv(runtime.INTERPRET_ENV, raising=False)


def _fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ROCm build of torch that sees one MI300X (nothing is launched)."""
    monkeypatch.setattr(torch.version, "hip", "6.3.42131")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "AMD Instinct MI300X")
    props = SimpleNamespace(gcnArchName="gfx942:sramecc+:xnack-")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (180 << 30, 192 << 30))


def test_entry_point_and_registration() -> None:
    """``rocm = plinth_rocm.plugin``; one RocmBackend with the rccl communicator and AMD launch options."""
    pyproject = tomllib.loads((ROOT / "plugins/rocm/pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["plinth.backends"] == {"rocm": "plinth_rocm.plugin"}
    (rocm,) = plugin.plinth_register_backends()
    assert isinstance(rocm, RocmBackend) and rocm.communicator == "rccl" and rocm.amd


@pytest.mark.parametrize(
    "name,arch", [("gfx942:sramecc+:xnack-", "gfx942"), ("gfx90a", "gfx90a"), ("gfx1100", "gfx1100"), ("", "gfx90a")]
)
def test_gfx_arch(name: str, arch: str) -> None:
    """The LLVM target without feature suffixes."""
    assert gfx_arch(name) == arch


@pytest.mark.usefixtures("hardware_mode")
def test_probe_without_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU build of torch: score 0 naming it; a ROCm build without a device: "no ROCm device visible"."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", None)
    probe = RocmBackend().probe()
    assert probe.score == 0 and probe.reasons == (f"torch {torch.__version__} has no ROCm (HIP) support",)
    monkeypatch.setattr(torch.version, "hip", "6.3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    probe = RocmBackend().probe()
    assert probe.score == 0 and probe.reasons[0].startswith("no ROCm device visible")


@pytest.mark.usefixtures("hardware_mode")
def test_probe_with_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A (simulated) MI300X: full score, gfx942 tuning with waves_per_eu, cuda_graphs declared."""
    _fake_gpu(monkeypatch)
    probe = RocmBackend().probe()
    assert probe.score == HARDWARE_SCORE and not probe.emulation and probe.device_name == "AMD Instinct MI300X"
    assert "(gfx942)" in probe.reasons[0] and "180.0 GiB free of 192.0 GiB" in probe.reasons[1]
    target = RocmBackend().target()
    assert target.arch == "gfx942" and target.amd and not target.upcast
    launch = target.launch(4, 1, target.attention().extra)
    assert launch["waves_per_eu"] == 2 and launch["num_warps"] == 4
    assert "cuda_graphs" in RocmBackend().capabilities().features
    monkeypatch.setattr(runtime, "triton_status", lambda: runtime.TritonStatus(False, "triton is not importable (x)"))
    assert RocmBackend().probe().score == 0


def test_interpreter_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """PLINTH_TRITON_INTERPRET=1: emulation in the interpreter, low score, no AMD launch options."""
    monkeypatch.setenv(runtime.INTERPRET_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the probe sets it to 1: restored after the test
    monkeypatch.setattr(runtime, "triton_status", lambda: runtime.TritonStatus(True, "triton 9.9"))
    probe = RocmBackend().probe()
    assert probe.score == INTERPRETER_SCORE and probe.emulation and probe.device_name == INTERPRETER_DEVICE
    assert RocmBackend().target().launch(4, 1, {"waves_per_eu": 2}) == {}


@pytest.mark.triton_interpret
def test_attention_through_the_rocm_backend() -> None:
    """The shared kernels through RocmBackend.attention_kernels match the reference."""
    batch = paged_batch([(1, 17), (6, 30)], 4, 2, 16, seed=11)
    kernels = RocmBackend().attention_kernels(AttentionSpec(4, 2, 16, 16))
    out = kernels.forward(batch.query, batch.kv_cache, batch.meta, SCALE)
    torch.testing.assert_close(out, batch.reference(), rtol=2e-5, atol=2e-5)
