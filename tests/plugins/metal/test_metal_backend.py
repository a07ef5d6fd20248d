"""The metal backend's probe, modes, memory and allocation limit (on Linux: score 0, or emulation)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from plinth_metal import backend as metal
from plinth_metal.backend import (
    EMULATE_ENV,
    MEMORY_FRACTION_ENV,
    MetalBackend,
    diagnose,
    memory_fraction,
    unified_memory,
)

from plinth.platform.backend import AttentionSpec, NotSupported
from plinth.platform.host import default_host


@pytest.fixture()
def emulate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EMULATE_ENV, "1")


# -- probe -----------------------------------------------------------------------------------------


def test_on_linux_the_probe_scores_zero_naming_the_os(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    probe = MetalBackend().probe()
    assert probe.score == 0 and not probe.emulation
    assert probe.reasons == ("not macOS (Linux): Apple Silicon's MPS is macOS-only",)


@pytest.mark.parametrize(
    "system,mac,built,available,reason",
    [
        ("Windows", "", False, False, "not macOS (Windows)"),
        ("Darwin", "14.4", False, False, "was built without MPS"),
        ("Darwin", "12.1", True, False, "macOS 12.1 is too old: torch's MPS needs macOS 12.3 or newer"),
        ("Darwin", "11.7.10", True, False, "macOS 11.7.10 is too old"),
        ("Darwin", "14.4", True, False, "no Metal device is available"),
    ],
)
def test_each_reason_mps_cannot_run(system: str, mac: str, built: bool, available: bool, reason: str) -> None:
    [why] = diagnose(system, mac, built, available)
    assert reason in why


def test_a_working_mps_has_no_reason() -> None:
    assert diagnose("Darwin", "15.1", True, True) == ()


def test_plinth_backends_lists_metal_with_score_zero_and_its_reason() -> None:
    env = {k: v for k, v in os.environ.items() if k != EMULATE_ENV}
    out = subprocess.run(
        [sys.executable, "-m", "plinth", "backends"], capture_output=True, text=True, env=env, timeout=120, check=True
    ).stdout
    [row] = [line for line in out.splitlines() if line.split()[:1] == ["metal"]]
    assert row.split()[1] == "0" and "not macOS (Linux)" in row, row


def test_emulation_is_labelled_and_picked_only_by_name(emulate: None) -> None:
    probe = MetalBackend().probe()
    assert probe.score == 5 and probe.emulation and "emulation" in probe.device_name
    assert default_host().select(None).backend.name != "metal"
    assert default_host().select("metal").backend.name == "metal"


def test_emulation_declares_all_three_float_dtypes_on_the_cpu(emulate: None) -> None:
    backend = MetalBackend()
    caps = backend.capabilities()
    assert caps.dtypes == caps.kv_cache_dtypes == {"float32", "bfloat16", "float16"}
    services = backend.device_services()
    assert services.device.type == "cpu" and services.default_dtype() == "float32"


# -- unified memory --------------------------------------------------------------------------------


def test_unified_memory_counts_what_the_driver_holds_as_used() -> None:
    gib = 1 << 30
    assert unified_memory(16 * gib, 3 * gib, 1.0) == (13 * gib, 16 * gib)
    assert unified_memory(16 * gib, 3 * gib, 0.5) == (5 * gib, 8 * gib)
    assert unified_memory(16 * gib, 20 * gib, 0.5) == (0, 8 * gib)


@pytest.mark.parametrize("raw,message", [("abc", "is not a number"), ("0", "outside (0, 1]"), ("1.5", "outside")])
def test_a_bad_memory_fraction_is_refused_by_name(raw: str, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MEMORY_FRACTION_ENV, raw)
    with pytest.raises(ValueError, match=MEMORY_FRACTION_ENV) as e:
        memory_fraction()
    assert message in str(e.value) and repr(raw) in str(e.value)


def test_emulation_memory_is_the_hosts_times_the_fraction(emulate: None, monkeypatch: pytest.MonkeyPatch) -> None:
    services = MetalBackend().device_services()
    monkeypatch.delenv(MEMORY_FRACTION_ENV, raising=False)
    _, total = services.memory_info()
    monkeypatch.setenv(MEMORY_FRACTION_ENV, "0.25")
    free, quarter = services.memory_info()
    assert quarter == int(total * 0.25) and 0 < free <= quarter


# -- defect (c): the 4 GB single-allocation limit --------------------------------------------------


def test_c_a_layer_cache_past_4_gib_is_refused_with_its_size(emulate: None) -> None:
    spec = AttentionSpec(32, 8, 128, 16, dtype="float16", kv_cache_dtype="float16")  # 64 KiB per block
    with pytest.raises(NotSupported) as e:
        MetalBackend().allocate_kv_cache(spec, 65537)  # one block over 4 GiB; nothing is allocated
    message = str(e.value)
    assert "4295032832 bytes" in message and "4 GiB single-allocation limit" in message
    assert "at most 65536 blocks" in message


def test_c_a_cache_at_the_limit_is_allocated(emulate: None, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = AttentionSpec(4, 2, 64, 16)  # 16 KiB per block in float32
    monkeypatch.setattr(metal, "MAX_BUFFER_BYTES", 4 * 16384)
    cache = MetalBackend().allocate_kv_cache(spec, 4)
    assert cache.shape == (2, 4, 16, 2, 64) and cache.dtype == torch.float32 and not cache.any()
    with pytest.raises(NotSupported, match="at most 4 blocks"):
        MetalBackend().allocate_kv_cache(spec, 5)
