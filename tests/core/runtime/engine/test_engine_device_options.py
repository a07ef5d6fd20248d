"""What the engine asks of a backend's device at start-up: the thread count through its services
(before any kernel is asked for), and KV caches with the ``prefault`` option where the backend's
``allocate_kv_cache`` takes it (API 1.4), without it where it was written before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import host_with, save_tiny_folder

from plinth.config import EngineConfig
from plinth.platform.backend import AttentionSpec, DeviceServices, GemmKernels
from plinth.platform.devices import HOST
from plinth.platform.reference import ReferenceBackend
from plinth.runtime.engine import LLMEngine, allocate_kv_caches

SPEC = AttentionSpec(2, 2, 16, 16)


class _Services(DeviceServices):
    def __init__(self, calls: list[str]) -> None:
        super().__init__(HOST)
        self.calls = calls

    def set_num_threads(self, n: int) -> None:
        self.calls.append(f"threads {n}")


class _Recording(ReferenceBackend):
    """The reference backend, recording the engine's calls in order."""

    name = "recording"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self._recording = _Services(self.calls)

    def device_services(self) -> DeviceServices:
        return self._recording

    def gemm_kernels(self, dtype: str) -> GemmKernels:
        self.calls.append("gemm")
        return super().gemm_kernels(dtype)

    def allocate_kv_cache(self, spec: AttentionSpec, num_blocks: int, *, prefault: bool = False) -> torch.Tensor:
        self.calls.append(f"kv prefault={prefault}")
        return super().allocate_kv_cache(spec, num_blocks, prefault=prefault)


class _Before14(ReferenceBackend):
    """A backend whose ``allocate_kv_cache`` override predates the ``prefault`` option."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated = 0

    def allocate_kv_cache(self, spec: AttentionSpec, num_blocks: int) -> torch.Tensor:  # type: ignore[override]
        self.allocated += 1
        # garbage where a lazily mapped cache would hold untouched pages: a prefault must write it
        return torch.full((2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size), 7.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_folder("llama", path)
    return path


@pytest.mark.parametrize("prefault", [True, False])
def test_threads_before_kernels_and_prefault_passed_on(folder: Path, prefault: bool) -> None:
    backend = _Recording()
    host = host_with("recording", backend)
    config = EngineConfig(
        model=str(folder), backend="recording", num_threads=3, num_kv_blocks=8, kv_cache_prefault=prefault
    )
    LLMEngine(config, host=host)
    assert backend.calls[:2] == ["threads 3", "gemm"]
    assert f"kv prefault={prefault}" in backend.calls


def test_no_thread_count_leaves_the_backend_default(folder: Path) -> None:
    backend = _Recording()
    host = host_with("recording", backend)
    LLMEngine(EngineConfig(model=str(folder), backend="recording", num_kv_blocks=8), host=host)
    assert not [c for c in backend.calls if c.startswith("threads")]


def test_an_allocator_without_prefault_is_called_without_it() -> None:
    """As pluggy prunes a hook argument an old implementation does not take: no TypeError."""
    old = _Before14()
    caches = allocate_kv_caches(old, [SPEC, SPEC], 4, prefault=True)
    assert old.allocated == 2 and [tuple(c.shape) for c in caches] == [(2, 4, 16, 2, 16)] * 2
    # the engine touches every page itself, as it did for every backend before 1.4
    assert not any(bool(c.any()) for c in caches)
    [untouched] = allocate_kv_caches(old, [SPEC], 4, prefault=False)
    assert bool((untouched == 7.0).all())


def test_the_default_allocator_takes_prefault_and_writes_zeros() -> None:
    for prefault in (True, False):
        [cache] = allocate_kv_caches(ReferenceBackend(), [SPEC], 3, prefault=prefault)
        assert not bool(cache.any()) and cache.device == HOST


def test_default_services_set_torch_threads_and_read_by_sum() -> None:
    services = DeviceServices(HOST)
    before = torch.get_num_threads()
    try:
        services.set_num_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    probes = services.read_probes()
    assert list(probes) == ["torch_sum"]
    assert float(probes["torch_sum"](torch.ones(4096))) == 4096  # type: ignore[arg-type]
