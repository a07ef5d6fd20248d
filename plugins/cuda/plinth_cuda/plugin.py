"""Entry point of the ``plinth-cuda`` distribution (group ``plinth.backends``, name ``cuda``).

Importing this module only defines objects: the GPU is inspected in ``CudaBackend.probe()``, so a
machine without CUDA (or without triton) still loads the plugin and gets score 0 with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from plinth.hookspecs import hookimpl
from plinth.platform.backend import Backend
from plinth_cuda.backend import CudaBackend


@hookimpl
def plinth_register_backends() -> Sequence[Backend]:
    """The CUDA backend: one object, cheap to build, touches no hardware."""
    return [CudaBackend()]
