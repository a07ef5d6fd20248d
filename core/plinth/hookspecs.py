# mypy: disable-error-code="empty-body"
"""The plinth plugin contract.

Every hook a backend plugin may implement is specified here, and only here. A plugin is a module (or
object) found through the ``plinth.backends`` entry-point group; the built-in reference backend is
registered through that same group, exactly like a third-party one.

Hooks are resolved once, when the engine starts or a model loads; they are never called in the
per-token loop. What a hook hands back are plain objects (:class:`plinth.platform.Backend`, kernel
objects) whose methods the step loop calls directly.

Versioning: :data:`PLUGIN_API_VERSION` is ``(major, minor)``. A plugin declares the version it was
written against (``Backend.api_version``). A different major is rejected with a message naming the
plugin; a smaller minor is accepted. New arguments are only ever *added* to a hook: pluggy passes an
implementation only the arguments it names, so an old implementation keeps working. A hook is never
renamed in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from plinth.platform.backend import Backend, KernelProvider

#: The entry-point group (and pluggy project name) every backend plugin registers under.
PROJECT_NAME = "plinth.backends"

#: ``(major, minor)``: a plugin written for another major is refused; minors only add.
PLUGIN_API_VERSION: tuple[int, int] = (1, 3)

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -------------------------------------------------------------------------------------------------
# Discovery: called once when the plugin host starts.
# -------------------------------------------------------------------------------------------------


@hookspec
def plinth_register_backends() -> Sequence[Backend]:
    """Return the backends this plugin provides.

    Called by the plugin host once, right after every entry point of the ``plinth.backends`` group
    has been loaded, one plugin at a time (so an error is attributed to the plugin that raised it).

    :return: a sequence of :class:`plinth.platform.Backend` objects, usually one. Each backend's
        ``name`` must be unique across all installed plugins; its ``api_version`` is checked against
        :data:`PLUGIN_API_VERSION` before anything else is asked of it.

    The implementation must be cheap and must not touch the hardware: constructing a backend object
    must never fail because a device is missing. Hardware checks belong in ``Backend.probe()``,
    which reports "unusable" as a score of 0 with reasons.

    .. versionadded:: 1.0
    """


@hookspec
def plinth_register_kernels(backend_name: str) -> Sequence[KernelProvider]:
    """Contribute attention or GEMM kernels to an existing backend.

    Called by the plugin host once per selected backend, when the engine builds its kernels. A
    kernel plugin (say, a faster attention for the ``cpu`` backend) returns providers whose
    ``backend_name`` matches; every other plugin returns an empty sequence (or does not implement
    the hook).

    :param backend_name: the name of the backend the engine selected.
    :return: kernel providers. Among the backend's own kernels and the providers that declare the
        requested case supported, the one with the highest ``priority`` is used.

    .. versionadded:: 1.0
    """
