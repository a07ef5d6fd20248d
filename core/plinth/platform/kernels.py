"""Choosing the kernels the step loop will call: backend, contributed providers, reference fallback.

Resolution happens once per model load. Among the selected backend's own kernels (priority 0) and
the providers other plugins contribute (``plinth_register_kernels``), the highest-priority one that
covers the case wins. When none does, the core falls back per op to the reference kernel with a
warning, or raises :class:`NotSupported` in strict mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from plinth.platform.backend import (
    AttentionKernels,
    AttentionSpec,
    Backend,
    GemmKernels,
    KernelProvider,
    NotSupported,
    SmallOps,
    torch_dtype,
)
from plinth.platform.reference import ReferenceAttention, ReferenceGemm

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KernelSet:
    """The kernels one model instance uses, plus a record of every fallback taken."""

    backend: Backend
    gemm: GemmKernels
    ops: SmallOps
    attention: Callable[[AttentionSpec], AttentionKernels]
    fallbacks: list[str] = field(default_factory=list)


def resolve_kernels(
    backend: Backend, providers: Sequence[KernelProvider], dtype: str, strict: bool = False
) -> KernelSet:
    """Resolve GEMM and small ops now, and return an attention factory that resolves per layer spec.

    :param strict: raise :class:`NotSupported` instead of falling back to the reference kernels.
    """
    fallbacks: list[str] = []
    layout = backend.capabilities().kv_cache_layout

    def fallback(what: str, err: NotSupported) -> None:
        if strict:
            raise err
        note = f"{what}: {err}; using the reference kernel (slow)"
        logger.warning(note)
        fallbacks.append(note)

    gemm: GemmKernels | None = None
    for provider in providers:
        if provider.priority > 0 and (gemm := provider.gemm_kernels(dtype)) is not None:
            break
    if gemm is None:
        try:
            gemm = backend.gemm_kernels(dtype)
        except NotSupported as err:
            gemm = next((g for p in providers if (g := p.gemm_kernels(dtype)) is not None), None)
            if gemm is None:
                fallback("GEMM", err)
                gemm = ReferenceGemm(torch_dtype(dtype))

    def attention(spec: AttentionSpec) -> AttentionKernels:
        for provider in providers:
            if provider.priority > 0 and (kernels := provider.attention_kernels(spec, layout)) is not None:
                return kernels
        try:
            return backend.attention_kernels(spec)
        except NotSupported as err:
            for provider in providers:
                if (kernels := provider.attention_kernels(spec, layout)) is not None:
                    return kernels
            if layout.dims != ReferenceAttention.default_layout().dims:
                raise NotSupported(
                    backend.name,
                    "attention",
                    [*err.reasons, "and its KV layout rules out the reference fallback"],
                ) from err
            fallback("attention", err)
            return ReferenceAttention(spec, layout)

    return KernelSet(backend=backend, gemm=gemm, ops=backend.small_ops(), attention=attention, fallbacks=fallbacks)
