"""The plugin host: discovery through entry points, API-version checks, probing and selection.

Every backend, the built-in reference one included, arrives through the ``plinth.backends``
entry-point group. A plugin that fails to import, fails ``check_pending()``, declares another API
major, or whose probe raises is *reported* with its distribution name and the error; the other
plugins still load. Nothing is swallowed: selection shows the failure, and naming a failed backend
raises it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import pluggy

from plinth import hookspecs
from plinth.platform.values import Probe

if TYPE_CHECKING:  # the host itself stays torch-free: plugins bring torch if they need it
    from plinth.platform.backend import Backend, KernelProvider

logger = logging.getLogger(__name__)

#: Environment variable naming the backend to use (same as ``--backend``).
BACKEND_ENV = "PLINTH_BACKEND"


class BackendError(RuntimeError):
    """A backend cannot be selected: unknown, unusable, or broken. The message says which and why."""


@dataclass(slots=True)
class PluginInfo:
    """One entry point of the ``plinth.backends`` group, loaded or not."""

    name: str  # entry-point name
    dist_name: str
    dist_version: str
    module: str
    hooks: list[str] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)
    error: str | None = None  # why the plugin was not loaded


@dataclass(slots=True)
class BackendStatus:
    """A registered backend and its probe (or the error its probe raised)."""

    backend: Backend
    plugin: PluginInfo
    probe: Probe | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        """The backend's name."""
        return self.backend.name

    @property
    def score(self) -> int:
        """The probe's score; 0 when the probe failed."""
        return self.probe.score if self.probe is not None else 0

    @property
    def reasons(self) -> tuple[str, ...]:
        """The probe's reasons, or the probe's error."""
        if self.error is not None:
            return (self.error,)
        return self.probe.reasons if self.probe is not None else ()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class PluginHost:
    """Loads backend plugins and answers "which backend?".

    :param group: the entry-point group to scan (tests point it elsewhere).
    :param plugins: extra ``(name, module_or_object)`` pairs registered as if found by entry point;
        used by tests and by embedding applications.
    """

    def __init__(self, group: str = hookspecs.PROJECT_NAME, plugins: tuple[tuple[str, object], ...] = ()):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginInfo] = []
        self._backends: dict[str, BackendStatus] = {}
        self._probed = False
        for ep in sorted(entry_points(group=group), key=lambda e: e.name):
            dist = ep.dist
            info = PluginInfo(
                name=ep.name,
                dist_name=dist.name if dist is not None else "?",
                dist_version=dist.version if dist is not None else "?",
                module=ep.value,
            )
            self._load(info, ep.load)
        for name, obj in plugins:
            info = PluginInfo(name=name, dist_name=name, dist_version="-", module=repr(obj))
            self._load(info, lambda obj=obj: obj)

    # -- discovery ---------------------------------------------------------------------------------

    def _load(self, info: PluginInfo, load: object) -> None:
        self.plugins.append(info)
        try:
            plugin = load()  # type: ignore[operator]
        except Exception as exc:  # a broken plugin must not take the others down
            info.error = f"failed to import {info.module}: {_describe(exc)}"
            logger.warning("plugin %s (%s): %s", info.name, info.dist_name, info.error)
            return
        if self.pm.is_registered(plugin) or self.pm.has_plugin(info.name):
            info.error = f"plugin name {info.name!r} registered twice"
            return
        try:
            self.pm.register(plugin, name=info.name)
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self.pm.unregister(name=info.name)
            info.error = f"invalid hook implementation: {exc}"
            logger.warning("plugin %s (%s): %s", info.name, info.dist_name, info.error)
            return
        info.hooks = sorted(
            caller.name for caller in self.pm.get_hookcallers(plugin) or [] if caller.name.startswith("plinth_")
        )
        self._register_backends(info)

    def _call_one(self, info: PluginInfo, hook: str, **kwargs: object) -> list[Any]:
        """Call ``hook`` on plugin ``info`` alone, through pluggy.

        Through pluggy (never ``impl.function()``) so that each implementation receives only the
        arguments it names: a hook that gained an argument in a later minor still calls a plugin
        written against the older signature. One plugin at a time so an error names its plugin.
        ``kwargs`` must carry every argument of the current spec (pluggy warns otherwise).
        """
        plugin = self.pm.get_plugin(info.name)
        others = [p for p in self.pm.get_plugins() if p is not plugin]
        caller = self.pm.subset_hook_caller(hook, remove_plugins=others)
        return list(caller(**kwargs))

    def _register_backends(self, info: PluginInfo) -> None:
        try:
            batches = self._call_one(info, "plinth_register_backends")
        except Exception as exc:
            info.error = f"plinth_register_backends raised {_describe(exc)}"
            logger.warning("plugin %s (%s): %s", info.name, info.dist_name, info.error)
            return
        for batch in batches:
            for backend in batch:
                self._add_backend(info, backend)

    def _add_backend(self, info: PluginInfo, backend: Backend) -> None:
        name = getattr(backend, "name", None)
        if not isinstance(name, str) or not name:
            info.error = f"registered a backend without a name: {backend!r}"
            return
        major, minor = hookspecs.PLUGIN_API_VERSION
        want = tuple(getattr(backend, "api_version", (0, 0)))
        if want[0] != major or want[1] > minor:
            info.error = (
                f"backend {name!r} from {info.dist_name} needs plugin API {want[0]}.{want[1]}, "
                f"this plinth provides {major}.{minor}"
            )
            logger.warning(info.error)
            return
        if name in self._backends:
            other = self._backends[name].plugin.dist_name
            info.error = f"backend name {name!r} already registered by {other}"
            logger.warning(info.error)
            return
        info.backends.append(name)
        self._backends[name] = BackendStatus(backend=backend, plugin=info)

    # -- probing and selection -----------------------------------------------------------------------

    def statuses(self) -> list[BackendStatus]:
        """Every registered backend with its probe, best first (probes run once, on first call)."""
        if not self._probed:
            for status in self._backends.values():
                try:
                    status.probe = status.backend.probe()
                except Exception as exc:  # reported in the table and on selection, never hidden
                    status.error = f"probe raised {_describe(exc)} (plugin {status.plugin.dist_name})"
                    logger.warning("backend %s: %s", status.name, status.error)
            self._probed = True
        return sorted(self._backends.values(), key=lambda s: (-s.score, s.name))

    def names(self) -> list[str]:
        """Names of the registered backends."""
        return sorted(self._backends)

    def select(self, name: str | None = None) -> BackendStatus:
        """The backend to use: ``name``, else ``$PLINTH_BACKEND``, else the highest probe score.

        :raises BackendError: the named backend is unknown, unusable or broken, or none is usable.
        """
        name = name or os.environ.get(BACKEND_ENV) or None
        statuses = self.statuses()
        if name is not None:
            by_name = {s.name: s for s in statuses}
            if name not in by_name:
                failed = [f"{p.name} ({p.dist_name}): {p.error}" for p in self.plugins if p.error]
                hint = f"; plugins that failed to load: {'; '.join(failed)}" if failed else ""
                raise BackendError(f"unknown backend {name!r}; installed: {', '.join(self.names())}{hint}")
            status = by_name[name]
            if status.error is not None:
                raise BackendError(f"backend {name!r} is broken: {status.error}")
            if status.score <= 0:
                raise BackendError(f"backend {name!r} cannot run here: {'; '.join(status.reasons)}")
            return status
        usable = [s for s in statuses if s.score > 0]
        if not usable:
            table = "; ".join(f"{s.name}: {', '.join(s.reasons)}" for s in statuses)
            raise BackendError(f"no usable backend ({table or 'none installed'})")
        return usable[0]

    def kernel_providers(self, backend_name: str) -> list[KernelProvider]:
        """Kernels other plugins contribute to ``backend_name``, highest priority first.

        Each plugin's ``plinth_register_kernels`` is called on its own: one that raises is reported
        (logged, and recorded as its plugin's ``error``) and contributes nothing; the others still
        do. A provider for another backend is dropped.

        :raises BackendError: ``backend_name`` is not a registered backend.
        """
        if backend_name not in self._backends:
            raise BackendError(f"unknown backend {backend_name!r}; installed: {', '.join(self.names())}")
        backend = self._backends[backend_name].backend
        providers: list[KernelProvider] = []
        for info in self.plugins:
            if "plinth_register_kernels" not in info.hooks:
                continue
            try:
                batches = self._call_one(info, "plinth_register_kernels", backend_name=backend_name, backend=backend)
            except Exception as exc:  # an optional speed-up must not stop the engine, nor vanish
                info.error = f"plinth_register_kernels raised {_describe(exc)}"
                logger.warning("plugin %s (%s): %s", info.name, info.dist_name, info.error)
                continue
            for batch in batches:
                providers.extend(p for p in batch if p.backend_name == backend_name)
        # sorted() is stable: equal priorities keep plugin (entry-point name) order
        return sorted(providers, key=lambda p: -p.priority)


_default_host: PluginHost | None = None


def default_host() -> PluginHost:
    """The process-wide host over the installed entry points (built on first use)."""
    global _default_host
    if _default_host is None:
        _default_host = PluginHost()
    return _default_host
