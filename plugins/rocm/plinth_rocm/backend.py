"""The ROCm backend: AMD GPUs through torch's HIP runtime (device type "cuda"), with the shared Triton kernels."""

from __future__ import annotations

import os
from importlib import metadata

import torch
from plinth_triton import runtime
from plinth_triton.backend import HARDWARE_SCORE, TritonBackend

from plinth.platform.backend import Probe

try:
    __version__ = metadata.version("plinth-rocm")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.1.0"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def gfx_arch(gcn_arch_name: str) -> str:
    """``"gfx942"`` from torch's ``gcnArchName`` (``"gfx942:sramecc+:xnack-"``)."""
    return gcn_arch_name.split(":", 1)[0].strip() or "gfx90a"


class RocmBackend(TritonBackend):
    """AMD Instinct / Radeon GPUs: the same Triton kernels with AMD tuning (64-wide wavefronts)."""

    name = "rocm"
    version = __version__
    description = "AMD GPUs (ROCm): Triton kernels (unified paged attention, GEMM, RMSNorm, rotary)"
    vendor = "ROCm"
    communicator = "rccl"
    amd = True

    def probe_hardware(self) -> Probe:
        """Score the visible ROCm device; 0 with the reason when torch, the device or triton is missing."""
        if torch.version.hip is None:
            hint = " (a CUDA build: use the cuda backend)" if torch.version.cuda else ""
            return Probe(0, (f"torch {torch.__version__} has no ROCm (HIP) support{hint}",))
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            visible = os.environ.get("HIP_VISIBLE_DEVICES", os.environ.get("ROCR_VISIBLE_DEVICES", "unset"))
            return Probe(0, (f"no ROCm device visible (torch {torch.__version__}, HIP_VISIBLE_DEVICES={visible})",))
        index = torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        arch = gfx_arch(torch.cuda.get_device_properties(index).gcnArchName)
        free, total = torch.cuda.mem_get_info(index)
        reasons = [
            f"{name} ({arch}), device {index} of {torch.cuda.device_count()}",
            f"{_gib(free)} free of {_gib(total)}",
            f"torch {torch.__version__}, HIP {torch.version.hip}",
        ]
        status = runtime.triton_status()
        if not status.available:
            return Probe(0, (*reasons, f"{status.detail}: install triton (ROCm builds of torch ship it)"), name)
        return Probe(HARDWARE_SCORE, (*reasons, status.detail), name)

    def arch(self) -> str:
        """The LLVM target of the current device, e.g. "gfx942"."""
        return gfx_arch(torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName)
