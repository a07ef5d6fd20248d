"""The ipex lane's tests: a fresh plugin host per test, and the source tree's plinth-ipex importable.

plinth-ipex is installed only in the ipex lane's venv (``scripts/ipex-venv.sh``: IPEX pins torch 2.8).
Its choice rule (:mod:`plinth_ipex.choice`) imports neither torch nor IPEX, so the main environment
tests it too, from the source tree; the kernel and engine tests skip there, naming why.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from plinth.platform import host

_ROOT = Path(__file__).resolve().parents[3]
if importlib.util.find_spec("plinth_ipex") is None:  # not installed: the main .venv
    sys.path.insert(0, str(_ROOT / "plugins" / "ipex"))
# the cpu backend's hostile attention batches (test_cpu_attention.make_batch), whichever tests were collected
sys.path.insert(0, str(_ROOT / "tests" / "plugins" / "cpu"))


@pytest.fixture(autouse=True)
def fresh_default_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test finds the plugins (and reads ``PLINTH_IPEX_OPS``) anew."""
    monkeypatch.setattr(host, "_default_host", None)
    yield
