"""Entry point of the ``plinth-gaudi`` distribution (group ``plinth.backends``, name ``gaudi``).

Importing this module never imports ``habana_frameworks``: a machine without Gaudi's software stack
still loads the plugin and lists ``gaudi`` with score 0 and why.
"""

from __future__ import annotations

from collections.abc import Sequence

from plinth.hookspecs import hookimpl
from plinth.platform.backend import Backend
from plinth_gaudi.backend import GaudiBackend


@hookimpl
def plinth_register_backends() -> Sequence[Backend]:
    """The gaudi backend: one object, cheap to build, touches no hardware."""
    return [GaudiBackend()]
