"""The CUDA backend: NVIDIA GPUs through torch's CUDA runtime, with the shared Triton kernels."""

from __future__ import annotations

import os
from importlib import metadata

import torch
from plinth_triton import runtime
from plinth_triton.backend import HARDWARE_SCORE, NO_BF16_SCORE, TritonBackend

from plinth.platform.backend import Probe

try:
    __version__ = metadata.version("plinth-cuda")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.1.0"

#: Triton generates code for Volta (7.0) and newer.
MIN_CAPABILITY = (7, 0)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


class CudaBackend(TritonBackend):
    """NVIDIA GPUs: Triton paged attention, GEMM and small ops; bfloat16 by default (sm80+)."""

    name = "cuda"
    version = __version__
    description = "NVIDIA GPUs: Triton kernels (unified paged attention, GEMM, RMSNorm, rotary)"
    vendor = "CUDA"
    communicator = "nccl"

    def probe_hardware(self) -> Probe:
        """Score the visible CUDA device; 0 with the reason when torch, the device or triton is missing."""
        if torch.version.cuda is None:
            hint = " (a ROCm build: use the rocm backend)" if torch.version.hip else ""
            return Probe(0, (f"torch {torch.__version__} has no CUDA support{hint}",))
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
            return Probe(0, (f"no CUDA device visible (torch {torch.__version__}, CUDA_VISIBLE_DEVICES={visible})",))
        index = torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        free, total = torch.cuda.mem_get_info(index)
        reasons = [
            f"{name}, compute capability {major}.{minor}, cuda:{index} of {torch.cuda.device_count()}",
            f"{_gib(free)} free of {_gib(total)}",
            f"torch {torch.__version__}, CUDA {torch.version.cuda}",
        ]
        status = runtime.triton_status()
        if not status.available:
            return Probe(0, (*reasons, f"{status.detail}: install triton (CUDA builds of torch ship it)"), name)
        reasons.append(status.detail)
        if (major, minor) < MIN_CAPABILITY:
            return Probe(0, (*reasons, "Triton needs compute capability 7.0 or newer"), name)
        if major < 8:
            return Probe(NO_BF16_SCORE, (*reasons, "no bfloat16 before sm80: float16 by default"), name)
        return Probe(HARDWARE_SCORE, tuple(reasons), name)

    def arch(self) -> str:
        """``"sm<major><minor>"`` of the current device, e.g. "sm90"."""
        major, minor = torch.cuda.get_device_capability()
        return f"sm{major}{minor}"
