"""plinth-rocm: the plinth backend for AMD GPUs (ROCm), on the shared Triton kernels (plinth-triton-kernels).

Registered under the ``plinth.backends`` entry-point group as ``rocm``. Importing it never touches
the GPU nor imports triton: ``RocmBackend.probe()`` says what is there.
"""

from __future__ import annotations

from plinth_rocm.backend import RocmBackend, __version__

__all__ = ["RocmBackend", "__version__"]
