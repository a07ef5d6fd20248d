"""plinth-cuda: the plinth backend for NVIDIA GPUs (CUDA), on the shared Triton kernels (plinth-triton-kernels).

Registered under the ``plinth.backends`` entry-point group as ``cuda``. Importing it never touches
the GPU nor imports triton: ``CudaBackend.probe()`` says what is there.
"""

from __future__ import annotations

from plinth_cuda.backend import CudaBackend, __version__

__all__ = ["CudaBackend", "__version__"]
