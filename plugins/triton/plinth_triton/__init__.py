"""plinth-triton-kernels: the Triton kernels shared by plinth's CUDA and ROCm backends.

Unified paged attention over a varlen batch (with a split-KV path for long decodes), the KV-cache
write, GEMM (dense and weight-only int8/int4), RMSNorm and NeoX rotary; launch configs per GPU
architecture; and :class:`TritonBackend`, the base both vendor backends subclass. Importing this
package never imports triton: kernel modules are loaded once a backend is selected.
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("plinth-triton-kernels")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.1.0"

__all__ = ["__version__"]
