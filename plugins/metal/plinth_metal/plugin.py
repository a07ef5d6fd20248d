"""Entry point of the ``plinth-metal`` distribution (group ``plinth.backends``, name ``metal``).

Importing this module initialises no MPS device and never imports MLX: a machine without Apple
Silicon still loads the plugin and lists ``metal`` with score 0 and the reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from plinth.hookspecs import hookimpl
from plinth.platform.backend import Backend
from plinth_metal.backend import MetalBackend


@hookimpl
def plinth_register_backends() -> Sequence[Backend]:
    """The metal backend: one object, cheap to build, touches no hardware."""
    return [MetalBackend()]
