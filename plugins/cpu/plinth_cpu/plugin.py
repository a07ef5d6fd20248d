"""Entry point of the ``plinth-cpu`` distribution (group ``plinth.backends``, name ``cpu``).

Importing this module only defines objects: hardware is inspected in ``CpuBackend.probe()``, so a
host without SIMD (or without /proc) still loads the plugin and gets a low score with reasons.
"""

from __future__ import annotations

from collections.abc import Sequence

from plinth.hookspecs import hookimpl
from plinth.platform.backend import Backend
from plinth_cpu.backend import CpuBackend


@hookimpl
def plinth_register_backends() -> Sequence[Backend]:
    """The CPU backend: one object, cheap to build, touches no hardware."""
    return [CpuBackend()]
