"""A pytest plugin for the conformance run of the IPEX provider (loaded with ``-p``): the suite asks
the backend's kernel factories directly, so this routes the cpu backend's two factories through
:class:`plinth_ipex.provider.IpexProvider` first, as ``resolve_kernels`` does with the provider
installed. The provider's verdicts come from ``PLINTH_IPEX_OPS`` (``all`` certifies every op IPEX
covers, measured faster or not); undeclared cases still raise the backend's ``NotSupported``.
Test-only, as tests/plugins/metal/mlx_conformance_shim.py for the MLX provider."""

from __future__ import annotations

import pytest
from plinth_ipex.provider import IpexProvider

from plinth.platform.backend import AttentionKernels, AttentionSpec, GemmKernels
from plinth_cpu.backend import CpuBackend

#: What the kernel factories handed out in this session, by class name (printed at the end).
MADE: set[str] = set()


def pytest_configure(config: pytest.Config) -> None:
    own_attention, own_gemm = CpuBackend.attention_kernels, CpuBackend.gemm_kernels
    provider = IpexProvider()

    def attention_kernels(self: CpuBackend, spec: AttentionSpec) -> AttentionKernels:
        self.capabilities().require_attention(self.name, spec)
        kernels = provider.attention_kernels(spec, self.capabilities().kv_cache_layout) or own_attention(self, spec)
        MADE.add(type(kernels).__name__)
        return kernels

    def gemm_kernels(self: CpuBackend, dtype: str) -> GemmKernels:
        self.capabilities().require_gemm(self.name, dtype)
        provider.backend = None  # the quantized weights' own GEMM: the unpatched factory's
        kernels = provider.gemm_kernels(dtype)
        if kernels is not None:
            kernels.own = own_gemm(self, dtype)  # type: ignore[attr-defined]
        else:
            kernels = own_gemm(self, dtype)
        MADE.add(type(kernels).__name__)
        return kernels

    CpuBackend.attention_kernels = attention_kernels  # type: ignore[method-assign]
    CpuBackend.gemm_kernels = gemm_kernels  # type: ignore[method-assign]


def pytest_sessionfinish(session: pytest.Session) -> None:
    print(f"\nipex shim: kernels made: {sorted(MADE)}")
