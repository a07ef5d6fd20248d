"""Entry point of the ``plinth-ipex`` distribution (group ``plinth.backends``, name ``ipex``).

A kernel-only plugin: it registers no backend, and contributes IPEX's kernels to the ``cpu`` backend
through ``plinth_register_kernels`` (see :mod:`plinth_ipex.provider`). IPEX is imported only there,
once the cpu backend is selected.
"""

from __future__ import annotations

from collections.abc import Sequence

from plinth.hookspecs import hookimpl
from plinth.platform.backend import Backend, KernelProvider


@hookimpl
def plinth_register_kernels(backend_name: str, backend: Backend) -> Sequence[KernelProvider]:
    """The IPEX provider for ``cpu``; nothing for any other backend. Importing IPEX here (about a
    second) is the hook's whole cost: kernels are built per case as the model loads."""
    if backend_name != "cpu":
        return []
    from plinth_ipex.provider import IpexProvider

    return [IpexProvider(backend=backend)]
