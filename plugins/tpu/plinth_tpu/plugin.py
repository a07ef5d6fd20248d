"""Entry point of the ``plinth-tpu`` distribution (group ``plinth.backends``, name ``tpu``).

Importing this module imports neither JAX nor libtpu: the backend's probe looks for them, so a
machine without a TPU (or without JAX) still loads the plugin and lists ``tpu`` with score 0 and why.
"""

from __future__ import annotations

from collections.abc import Sequence

from plinth.hookspecs import hookimpl
from plinth.platform.backend import Backend
from plinth_tpu.backend import TpuBackend


@hookimpl
def plinth_register_backends() -> Sequence[Backend]:
    """The TPU backend: one object, cheap to build, touches no hardware."""
    return [TpuBackend()]
