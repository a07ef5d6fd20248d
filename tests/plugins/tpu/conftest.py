"""Tests of the TPU backend's kernels; they run on JAX's CPU backend (Pallas in interpret mode).

JAX_PLATFORMS=cpu before JAX is imported: with libtpu installed and no TPU, JAX would otherwise
try the TPU plugin first (and libtpu would log its failed host lookups); the AOT tests load the
TPU compiler through ``jax.experimental.topologies`` regardless.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # never ask a GCE metadata server for a TPU

pytest.importorskip("jax", reason="the tpu backend's tests need jax (pip install -e plugins/tpu)")


@pytest.fixture(autouse=True)
def fresh_default_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fresh process-wide plugin host per test: the default host probes each backend once per
    process, and these tests switch ``PLINTH_TPU_INTERPRET`` on and off."""
    from plinth.platform import host

    monkeypatch.setattr(host, "_default_host", None)
    yield
