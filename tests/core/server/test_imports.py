"""The server's modules import one way (issue 15: app <-> openai_api <-> anthropic_api was a cycle
hidden by a function-local import): each imports alone, and the shared ones pull no route module in."""

from __future__ import annotations

import subprocess
import sys

import pytest

ROUTES = {"plinth.server.app", "plinth.server.openai_api", "plinth.server.anthropic_api"}


@pytest.mark.parametrize("module", ["plinth.server.state", "plinth.server.openai_api", "plinth.server.anthropic_api"])
def test_module_imports_alone_without_the_routes_above_it(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m in {sorted(ROUTES)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    loaded = set(eval(out))  # noqa: S307 - our own printed list
    if module in ROUTES:
        assert loaded == {module}, loaded  # a route module does not import the app or the other routes
    else:
        assert not loaded, loaded
