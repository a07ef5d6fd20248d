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
    #: Called once per attention layer spec as the model is built.
    attention: Callable[[AttentionSpec], AttentionKernels]
    #: One line per op that fell back to the reference kernel (each distinct case once; attention
    #: cases are added as the model's layers are built). Logged as a warning when taken, and shown
    #: by ``plinth generate`` and in ``plinth bench`` results, since it means "slow".
    fallbacks: list[str] = field(default_factory=list)


def resolve_kernels(
    backend: Backend, providers: Sequence[KernelProvider], dtype: str, strict: bool = False
) -> KernelSet:
    """Resolve GEMM and small ops now, and return an attention factory that resolves per layer spec.

    For each op: providers with priority above 0 (``providers`` is highest first, as
    ``PluginHost.kernel_providers`` returns it) that cover the case; else the backend's own
    kernels; else, where the backend raises :class:`NotSupported`, any other provider that covers
    it; else the reference kernel with a warning (recorded in ``KernelSet.fallbacks``). Attention
    never falls back to the reference kernel when the backend's KV layout is not the reference's:
    the reference kernels could not read that cache.

    :param backend: the selected backend.
    :param providers: kernel providers contributed to it, highest priority first.
    :param dtype: the compute dtype name.
    :param strict: raise :class:`NotSupported` instead of falling back to the reference kernels.
    :raises NotSupported: in strict mode where a fallback would be taken, and for attention the
        backend's KV layout keeps from the reference kernel.
    """
    fallbacks: list[str] = []
    layout = backend.capabilities().kv_cache_layout
    providers = sorted(providers, key=lambda p: -p.priority)  # stable: equal priorities keep their order

    def fallback(what: str, err: NotSupported) -> None:
        if strict:
            raise err
        note = f"{what}: {err}; using the reference kernel (slow)"
        if note not in fallbacks:  # every layer of a model shares a spec: say it once
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
