"""Plugin host, backend selection and the objects backends hand to the core.

The value objects (:mod:`plinth.platform.values`) are imported eagerly; the tensor-facing ABCs
(:mod:`plinth.platform.backend`) on first use, so ``import plinth.platform.host`` stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plinth.platform.values import AttentionSpec, Capabilities, KVCacheLayout, NotSupported, Probe

if TYPE_CHECKING:
    from plinth.platform.backend import (
        AttentionKernels,
        AttentionMetadata,
        Backend,
        DeviceServices,
        GemmKernels,
        KernelProvider,
        LinearWeight,
        SmallOps,
        dtype_name,
        torch_dtype,
    )

_TORCH_NAMES = frozenset(
    {
        "AttentionKernels",
        "AttentionMetadata",
        "Backend",
        "DeviceServices",
        "GemmKernels",
        "KernelProvider",
        "LinearWeight",
        "SmallOps",
        "dtype_name",
        "torch_dtype",
    }
)

__all__ = [
    "AttentionKernels",
    "AttentionMetadata",
    "AttentionSpec",
    "Backend",
    "Capabilities",
    "DeviceServices",
    "GemmKernels",
    "KVCacheLayout",
    "KernelProvider",
    "LinearWeight",
    "NotSupported",
    "Probe",
    "SmallOps",
    "dtype_name",
    "torch_dtype",
]


def __getattr__(name: str) -> Any:
    # lazy, so that discovery (host, hookspecs, values) never imports torch
    if name in _TORCH_NAMES:
        from plinth.platform import backend

        return getattr(backend, name)
    raise AttributeError(f"module 'plinth.platform' has no attribute {name!r}")
