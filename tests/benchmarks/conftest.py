"""The benchmark scripts are not a package: the tests import them from benchmarks/ by name."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench() -> Callable[[str], ModuleType]:
    """``bench("attention")``: the module of benchmarks/attention.py (its sibling imports resolved)."""

    def load(name: str) -> ModuleType:
        sys.path.insert(0, str(BENCH))
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(str(BENCH))

    return load
