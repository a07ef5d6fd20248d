"""plinth-cpu: the plinth backend for x86-64 and Arm host CPUs.

Vectorised torch kernels (paged attention over a varlen batch, KV-cache writes, GEMM through
``F.linear``); registered under the ``plinth.backends`` entry-point group as ``cpu``.
"""

from __future__ import annotations

from plinth_cpu.backend import CpuBackend, __version__

__all__ = ["CpuBackend", "__version__"]
