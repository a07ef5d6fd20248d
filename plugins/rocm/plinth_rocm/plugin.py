"""Entry point of the ``plinth-rocm`` distribution (group ``plinth.backends``, name ``rocm``).

Importing this module only defines objects: the GPU is inspected in ``RocmBackend.probe()``, so a
machine without ROCm (or without triton) still loads the plugin and gets score 0 with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from plinth.hookspecs import hookimpl
from plinth.platform.backend import Backend
from plinth_rocm.backend import RocmBackend


@hookimpl
def plinth_register_backends() -> Sequence[Backend]:
    """The ROCm backend: one object, cheap to build, touches no hardware."""
    return [RocmBackend()]
