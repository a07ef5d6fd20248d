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
from typing import TypeVar

from plinth.platform.backend import (
    AttentionKernels,
    AttentionSpec,
    Backend,
    GemmKernels,
    KernelProvider,
    LoRAKernels,
    LoRASpec,
    MoEKernels,
    MoESpec,
    NotSupported,
    SmallOps,
    torch_dtype,
)
from plinth.platform.reference import ReferenceAttention, ReferenceGemm, ReferenceLoRA, ReferenceMoE

logger = logging.getLogger(__name__)

_K = TypeVar("_K", GemmKernels, AttentionKernels, MoEKernels, LoRAKernels)


def _reference_moe(spec: MoESpec) -> MoEKernels:
    return ReferenceMoE(spec)


def _reference_lora(spec: LoRASpec) -> LoRAKernels:
    return ReferenceLoRA(spec)


@dataclass(slots=True)
class KernelSet:
    """The kernels one model instance uses, plus a record of every fallback taken."""

    backend: Backend
    gemm: GemmKernels
    ops: SmallOps
    #: Called once per attention layer spec as the model is built.
    attention: Callable[[AttentionSpec], AttentionKernels]
    #: Called once per MoE layer spec as the model loads its experts (API 1.8).
    moe: Callable[[MoESpec], MoEKernels] = _reference_moe
    #: Called once when the engine enables LoRA (API 1.11).
    lora: Callable[[LoRASpec], LoRAKernels] = _reference_lora
    #: One line per op that fell back to the reference kernel (each distinct case once; attention
    #: cases are added as the model's layers are built). Logged as a warning when taken, and shown
    #: by ``plinth generate`` and in ``plinth bench`` results, since it means "slow".
    fallbacks: list[str] = field(default_factory=list)


def resolve_kernels(
    backend: Backend, providers: Sequence[KernelProvider], dtype: str, strict: bool = False
) -> KernelSet:
    """Resolve GEMM and small ops now, and return an attention factory that resolves per layer spec.

    For each op: providers with priority above 0 that cover the case, highest first (the chosen
    one is logged at INFO); else the backend's own kernels; else, where the backend raises
    :class:`NotSupported`, a provider of priority 0 or below that covers it; else the reference
    kernel with a warning (recorded in ``KernelSet.fallbacks``). Attention never falls back to the
    reference kernel when the backend's KV layout is not the reference's: the reference kernels
    could not read that cache.

    :param backend: the selected backend.
    :param providers: kernel providers contributed to it (``PluginHost.kernel_providers``), in
        any order: their priorities order them here, ties keeping the given order.
    :param dtype: the compute dtype name.
    :param strict: raise :class:`NotSupported` instead of falling back to the reference kernels.
    :raises NotSupported: in strict mode where a fallback would be taken, and for attention the
        backend's KV layout keeps from the reference kernel.
    """
    fallbacks: list[str] = []
    announced: set[str] = set()
    layout = backend.capabilities().kv_cache_layout
    ranked = sorted(providers, key=lambda p: -p.priority)  # stable: equal priorities keep their order
    preferred = [p for p in ranked if p.priority > 0]  # asked before the backend
    spare = [p for p in ranked if p.priority <= 0]  # asked only where the backend cannot

    def provided(group: list[KernelProvider], make: Callable[[KernelProvider], _K | None], what: str) -> _K | None:
        for provider in group:
            if (kernels := make(provider)) is not None:
                note = f"{what}: kernel provider {provider.name} (priority {provider.priority})"
                if note not in announced:  # every layer of a model shares a spec: say it once
                    announced.add(note)
                    logger.info(note)
                return kernels
        return None

    def fallback(what: str, err: NotSupported) -> None:
        if strict:
            raise err
        note = f"{what}: {err}; using the reference kernel (slow)"
        if note not in fallbacks:
            logger.warning(note)
            fallbacks.append(note)

    def make_gemm(provider: KernelProvider) -> GemmKernels | None:
        return provider.gemm_kernels(dtype)

    gemm = provided(preferred, make_gemm, f"GEMM in {dtype}")
    if gemm is None:
        try:
            gemm = backend.gemm_kernels(dtype)
        except NotSupported as err:
            gemm = provided(spare, make_gemm, f"GEMM in {dtype}")
            if gemm is None:
                fallback("GEMM", err)
                gemm = ReferenceGemm(torch_dtype(dtype))

    def attention(spec: AttentionSpec) -> AttentionKernels:
        def make(provider: KernelProvider) -> AttentionKernels | None:
            return provider.attention_kernels(spec, layout)

        what = f"attention for {spec}"
        if (kernels := provided(preferred, make, what)) is not None:
            return kernels
        try:
            return backend.attention_kernels(spec)
        except NotSupported as err:
            if (kernels := provided(spare, make, what)) is not None:
                return kernels
            if layout.dims != ReferenceAttention.default_layout().dims:
                raise NotSupported(
                    backend.name,
                    "attention",
                    [*err.reasons, "and its KV layout rules out the reference fallback"],
                ) from err
            fallback("attention", err)
            return ReferenceAttention(spec, layout)

    def moe(spec: MoESpec) -> MoEKernels:
        def make(provider: KernelProvider) -> MoEKernels | None:
            return provider.moe_kernels(spec)

        what = f"fused MoE for {spec}"
        if (kernels := provided(preferred, make, what)) is not None:
            return kernels
        try:
            return backend.moe_kernels(spec)
        except NotSupported as err:
            if (kernels := provided(spare, make, what)) is not None:
                return kernels
            fallback("fused MoE", err)
            return ReferenceMoE(spec)

    def lora(spec: LoRASpec) -> LoRAKernels:
        def make(provider: KernelProvider) -> LoRAKernels | None:
            return provider.lora_kernels(spec)

        what = f"batched LoRA for {spec}"
        if (kernels := provided(preferred, make, what)) is not None:
            return kernels
        try:
            return backend.lora_kernels(spec)
        except NotSupported as err:
            if (kernels := provided(spare, make, what)) is not None:
                return kernels
            fallback("LoRA", err)
            return ReferenceLoRA(spec)

    return KernelSet(
        backend=backend,
        gemm=gemm,
        ops=backend.small_ops(),
        attention=attention,
        moe=moe,
        lora=lora,
        fallbacks=fallbacks,
    )
