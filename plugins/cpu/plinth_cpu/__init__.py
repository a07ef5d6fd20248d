"""plinth-cpu: the plinth backend for x86-64 and Arm host CPUs.

Native AVX2/AVX-512 kernels in C (GEMM, paged attention, norms, rotary) and vectorised torch ops
elsewhere; registered under the ``plinth.backends`` entry-point group as ``cpu``. The package itself
imports no torch (its ``plinth.process_env`` entry point, :mod:`plinth_cpu.preflight`, runs before
torch starts); ``CpuBackend`` loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plinth_cpu.backend import CpuBackend

__all__ = ["CpuBackend", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("CpuBackend", "__version__"):
        from plinth_cpu import backend

        return getattr(backend, name)
    raise AttributeError(f"module 'plinth_cpu' has no attribute {name!r}")
