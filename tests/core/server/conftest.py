"""Fixtures of the server tests: the main server (once per session) and the offline reference."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from server_helpers import ServerProcess, running

#: the main server: the default model, a 1024-token context, outputs clamped to 64 tokens
MAIN_ARGS = ("--max-model-len", "1024", "--max-output-tokens", "64")


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """The main server, shared by every server test module."""
    yield from running(*MAIN_ARGS)


@pytest.fixture(scope="session")
def offline_llm() -> Any:
    """The offline API on the default model: the reference for the server's greedy outputs."""
    from plinth import LLM

    return LLM(max_model_len=1024)
