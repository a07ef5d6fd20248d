"""The ``triton_interpret`` marker's fixture, shared by the conftests of tests/plugins/{triton,cuda,rocm}.

Tests marked ``triton_interpret`` run the kernels in Triton's interpreter on CPU tensors: the
marker sets ``PLINTH_TRITON_INTERPRET=1`` (and ``TRITON_INTERPRET=1``) for the test, and skips it
when triton is not importable.
"""

from __future__ import annotations

import importlib.util

import pytest

TRITON_MISSING = importlib.util.find_spec("triton") is None


@pytest.fixture(autouse=True)
def triton_interpret_env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("triton_interpret") is None:
        return
    if TRITON_MISSING:
        pytest.skip("triton is not installed (pip install --no-deps triton): the interpreter lane needs it")
    monkeypatch.setenv("PLINTH_TRITON_INTERPRET", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # probes depend on the environment: the process-wide host must probe afresh under it
    import plinth.platform.host as host

    monkeypatch.setattr(host, "_default_host", None)
