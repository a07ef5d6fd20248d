"""The IPEX kernel provider for the cpu backend: GEMM and paged attention, per op where measured faster.

The verdict on each op (:mod:`plinth_ipex.choice`) is taken once, when the provider is built for an
engine, from the committed measurements of this host kind; the factories then hand out IPEX's kernels
for the chosen ops only and None for the rest, so the core keeps the cpu backend's own kernels there.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from plinth.platform.backend import (
    AttentionKernels,
    AttentionSpec,
    Backend,
    GemmKernels,
    KernelProvider,
    KVCacheLayout,
    NotSupported,
)
from plinth_cpu.attention import CPU_KV_LAYOUT
from plinth_ipex.attention import IpexAttention
from plinth_ipex.choice import OpChoice, choose, op_key
from plinth_ipex.gemm import DEFAULT_VARIANT, IpexGemm, cannot_pack

logger = logging.getLogger(__name__)

#: Above the cpu backend's own kernels (0): a chosen op is asked of IPEX first.
IPEX_PRIORITY = 20


def _ipex() -> Any:
    import intel_extension_for_pytorch as ipex

    return ipex


def isa_level() -> str:
    """The ISA level IPEX's CPU kernels dispatch to on this host (``AVX2``, ``AVX512``, ``AMX`` ...)."""
    return str(_ipex()._C._get_current_isa_level())


class IpexProvider(KernelProvider):
    """IPEX's GEMM and paged attention for the ``cpu`` backend, for the ops :attr:`choices` chose.

    :param choices: the verdict per op key (default: :func:`plinth_ipex.choice.choose` for this
        host's ISA level, from the committed table and ``PLINTH_IPEX_OPS``).
    :param backend: the cpu backend, whose GEMM keeps the quantized weights.
    """

    backend_name = "cpu"
    name = "ipex"
    priority = IPEX_PRIORITY
    api_version = (1, 10)

    def __init__(self, choices: dict[str, OpChoice] | None = None, backend: Backend | None = None) -> None:
        self.host_kind = isa_level()
        self.choices = choose(self.host_kind) if choices is None else choices
        self.backend = backend
        for choice in self.choices.values():
            logger.info("ipex: %s", choice.reason)

    def chosen(self) -> list[str]:
        """The op keys IPEX contributes."""
        return [k for k, c in self.choices.items() if c.chosen]

    def attention_kernels(self, spec: AttentionSpec, layout: KVCacheLayout) -> AttentionKernels | None:
        """:class:`IpexAttention` where its op was chosen, the cache is the cpu backend's layout and
        IPEX covers ``spec``; None otherwise (the cpu backend's kernel)."""
        choice = self.choices.get(op_key("attention", spec.dtype))
        if choice is None or not choice.chosen or layout.dims != CPU_KV_LAYOUT.dims:
            return None
        if (why := IpexAttention.covers(spec)) is not None:
            logger.info("ipex: attention for %s stays the cpu backend's: %s", spec, why)
            return None
        return IpexAttention(spec, layout)

    def gemm_kernels(self, dtype: str) -> GemmKernels | None:
        """:class:`IpexGemm` where its op was chosen (with the measured fastest IPEX kernel); None otherwise."""
        choice = self.choices.get(op_key("gemm", dtype))
        if choice is None or not choice.chosen:
            return None
        torch_dtype = getattr(torch, dtype)
        variant = choice.variant or DEFAULT_VARIANT[torch_dtype]
        if (why := cannot_pack(torch_dtype, variant)) is not None:
            logger.info("ipex: GEMM in %s stays the cpu backend's: IPEX cannot pack it here (%s)", dtype, why)
            return None
        own = None
        if self.backend is not None:
            try:
                own = self.backend.gemm_kernels(dtype)
            except NotSupported:
                own = None
        return IpexGemm(torch_dtype, variant, own)
