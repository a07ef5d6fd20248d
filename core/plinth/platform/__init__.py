"""Plugin host, backend selection and the objects backends hand to the core."""

from plinth.platform.backend import (
    AttentionKernels,
    AttentionMetadata,
    AttentionSpec,
    Backend,
    Capabilities,
    DeviceServices,
    GemmKernels,
    KernelProvider,
    KVCacheLayout,
    LinearWeight,
    NotSupported,
    Probe,
    SmallOps,
    dtype_name,
    torch_dtype,
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
