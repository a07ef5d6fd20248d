"""A pytest plugin for the conformance run of the MLX provider (loaded with ``-p``): the suite
certifies backends, not kernel providers, so this routes the metal backend's two kernel factories
through :class:`plinth_metal.mlx_provider.MlxProvider` first, as ``resolve_kernels`` would with the
provider offered. Undeclared cases still raise the backend's ``NotSupported`` (capabilities first).
Test-only: the contract seam this stands in for (a provider under conformance) is in the report."""

from __future__ import annotations

import pytest
from plinth_metal.backend import MetalBackend
from plinth_metal.mlx_provider import MlxProvider

from plinth.platform.backend import AttentionKernels, AttentionSpec, GemmKernels

#: What the kernel factories handed out in this session, by class name (checked by the test).
MADE: set[str] = set()


def pytest_configure(config: pytest.Config) -> None:
    own_attention, own_gemm = MetalBackend.attention_kernels, MetalBackend.gemm_kernels
    provider = MlxProvider()

    def attention_kernels(self: MetalBackend, spec: AttentionSpec) -> AttentionKernels:
        self.capabilities().require_attention(self.name, spec)
        kernels = provider.attention_kernels(spec, self.capabilities().kv_cache_layout) or own_attention(self, spec)
        MADE.add(type(kernels).__name__)
        return kernels

    def gemm_kernels(self: MetalBackend, dtype: str) -> GemmKernels:
        self.capabilities().require_gemm(self.name, dtype)
        kernels = provider.gemm_kernels(dtype) or own_gemm(self, dtype)
        MADE.add(type(kernels).__name__)
        return kernels

    MetalBackend.attention_kernels = attention_kernels  # type: ignore[method-assign]
    MetalBackend.gemm_kernels = gemm_kernels  # type: ignore[method-assign]


def pytest_sessionfinish(session: pytest.Session) -> None:
    print(f"\nmlx shim: kernels made: {sorted(MADE)}")
