"""Import torchax 0.0.13 on torch 2.13, which removed the named-tensor (Dimname) op overloads.

torchax 0.0.13 names ~20 of them at import and at ``Environment()`` (its AMP policy table and
decomposition list, e.g. ``aten.prod.dim_Dimname``, ``aten.std.names_dim``), so a plain
``import torchax`` raises ``AttributeError`` on torch 2.13. While torchax loads, a lookup of a
*missing named-tensor overload* returns an inert placeholder instead: torch's
``get_decompositions`` skips it (it is no operator) and an AMP table entry keyed by it is never
hit (torch 2.13 cannot dispatch such an overload). Every other lookup is untouched, and the hook
is removed once torchax has loaded.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
import torch._ops

_lock = threading.Lock()
_env: Any = None


class RemovedOverload:
    """Stands for an overload torch no longer has; hashable, never an operator."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"RemovedOverload({self.name})"


def _named_tensor_overload(name: str) -> bool:
    lowered = name.lower()
    return "dimname" in lowered or "names" in lowered


@contextlib.contextmanager
def _tolerate_removed_named_overloads() -> Iterator[None]:
    packet = torch._ops.OpOverloadPacket
    original = packet.__getattr__

    def getattr_(self: torch._ops.OpOverloadPacket, key: str) -> Any:
        try:
            return original(self, key)
        except AttributeError:
            if _named_tensor_overload(key):
                return RemovedOverload(f"{self._qualified_op_name}.{key}")
            raise

    packet.__getattr__ = getattr_  # type: ignore[method-assign]
    try:
        yield
    finally:
        packet.__getattr__ = original  # type: ignore[method-assign]


def import_torchax() -> tuple[ModuleType, Any]:
    """``(torchax, torchax.default_env())``, loaded once with the named-overload tolerance."""
    global _env
    with _lock:
        with _tolerate_removed_named_overloads():
            import torchax

            if _env is None:
                _env = torchax.default_env()  # builds the op tables: the second place they are named
        return torchax, _env
