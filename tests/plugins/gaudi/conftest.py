"""Every gaudi test starts from a fresh process-wide plugin host.

The default host probes each backend once per process; these tests switch emulation
(``PLINTH_GAUDI_EMULATE``) on and off, so a probe cached by an earlier test must not decide.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from plinth.platform import host


@pytest.fixture(autouse=True)
def fresh_default_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(host, "_default_host", None)
    yield
