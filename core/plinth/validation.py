"""Field checks for plinth's plain parameter records (:class:`~plinth.config.EngineConfig`,
:class:`~plinth.sampling_params.SamplingParams`).

The records are frozen dataclasses that check every field in ``__post_init__`` and raise
:class:`InvalidParameter` naming the first bad one. They do not use pydantic: importing it is about
0.3 s of ``plinth generate``'s cold start (the HTTP server, which needs pydantic anyway, keeps it for
its request schemas). An unknown keyword is Python's own ``TypeError``, which names it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


class InvalidParameter(ValueError):
    """A parameter whose value has the wrong type or is out of range; ``field`` names it."""

    def __init__(self, owner: str, field: str, problem: str) -> None:
        super().__init__(f"{owner}.{field}: {problem}")
        self.owner = owner
        self.field = field
        self.problem = problem


def _bounds(
    owner: str, field: str, value: float, ge: float | None, gt: float | None, le: float | None, lt: float | None
) -> None:
    for bound, ok, words in (
        (ge, lambda b: value >= b, "at least"),
        (gt, lambda b: value > b, "greater than"),
        (le, lambda b: value <= b, "at most"),
        (lt, lambda b: value < b, "less than"),
    ):
        if bound is not None and not ok(bound):
            raise InvalidParameter(owner, field, f"must be {words} {bound}, got {value!r}")


def check_int(
    owner: str,
    field: str,
    value: Any,
    *,
    optional: bool = False,
    ge: int | None = None,
    gt: int | None = None,
    le: int | None = None,
    lt: int | None = None,
) -> int | None:
    """``value`` as an int within the bounds (a float only when integral; never a bool)."""
    if value is None and optional:
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameter(owner, field, f"must be an integer{' or None' if optional else ''}, got {value!r}")
    _bounds(owner, field, value, ge, gt, le, lt)
    return value


def check_float(
    owner: str,
    field: str,
    value: Any,
    *,
    optional: bool = False,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> float | None:
    """``value`` as a float within the bounds (an int is taken; a bool or NaN is not)."""
    if value is None and optional:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (isinstance(value, float) and math.isnan(value))
    ):
        raise InvalidParameter(owner, field, f"must be a number{' or None' if optional else ''}, got {value!r}")
    value = float(value)
    _bounds(owner, field, value, ge, gt, le, lt)
    return value


def check_bool(owner: str, field: str, value: Any) -> bool:
    """``value``, which must be a bool."""
    if not isinstance(value, bool):
        raise InvalidParameter(owner, field, f"must be true or false, got {value!r}")
    return value


def check_str(owner: str, field: str, value: Any, *, optional: bool = False, choices: Iterable[str] = ()) -> str | None:
    """``value``, which must be a string (one of ``choices`` when given)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise InvalidParameter(owner, field, f"must be a string{' or None' if optional else ''}, got {value!r}")
    allowed = tuple(choices)
    if allowed and value not in allowed:
        raise InvalidParameter(owner, field, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def check_list(owner: str, field: str, value: Any, kind: type[int] | type[str]) -> list[Any]:
    """``value`` as a new list whose items are all ``kind`` (a bool is not an int)."""
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise InvalidParameter(owner, field, f"must be a list of {kind.__name__}, got {value!r}")
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, kind):
            raise InvalidParameter(owner, field, f"item {i} must be {kind.__name__}, got {item!r}")
    return list(value)
