"""Process environment a backend plugin asks for before torch starts (plugin API 1.15).

Some settings only take effect if they are in the environment when a runtime library loads: GNU
OpenMP reads ``OMP_WAIT_POLICY`` once, when torch is imported. A plugin names what it wants under
the entry-point group :data:`GROUP`: a callable that imports no torch and returns
``{variable: value}`` (it may look at the host, and return nothing). ``import plinth`` calls every
one and sets each variable the environment does not already hold (an operator's value wins), so
the engine's own ``import torch``, which comes later, sees them. Where torch was imported before
``plinth`` the values are still set (child processes inherit them), and :func:`report` says they came
too late for this process. ``PLINTH_PROCESS_ENV=0`` turns the whole mechanism off.
"""

from __future__ import annotations

import logging
import os
import sys
from importlib.metadata import entry_points

#: The entry-point group of the plugins' environment callables.
GROUP = "plinth.process_env"

logger = logging.getLogger(__name__)

#: ``{variable: (value, plugin entry point)}`` set by :func:`apply`; variables already set are absent.
applied: dict[str, tuple[str, str]] = {}
#: True where torch had been imported before :func:`apply` ran (its libraries had read their
#: environment already).
late = False


def apply() -> None:
    """Call every :data:`GROUP` entry point and set what it asks for where unset. A plugin whose
    callable fails is logged and skipped: it never breaks ``import plinth``."""
    global late
    if os.environ.get("PLINTH_PROCESS_ENV", "1") == "0":
        return
    late = "torch" in sys.modules
    for ep in entry_points(group=GROUP):
        try:
            wanted = ep.load()()
            items = [(str(k), str(v)) for k, v in dict(wanted).items()]
        except Exception as e:  # noqa: BLE001 - a broken plugin must not break the import
            logger.warning("plinth.process_env entry point %s failed: %s: %s", ep.name, type(e).__name__, e)
            continue
        for name, value in items:
            if name not in os.environ:
                os.environ[name] = value
                applied[name] = (value, ep.name)


def report(name: str) -> str:
    """One line on the variable ``name``: set by which plugin, in effect or too late, or left as the
    environment had it."""
    value = os.environ.get(name)
    if name in applied:
        wanted, plugin = applied[name]
        when = "too late for this process: torch was imported before plinth" if late else "before torch started"
        return f"{name}={wanted} (asked for by {plugin}; set {when})"
    if value is None:
        return f"{name} unset"
    return f"{name}={value} (from the environment)"
