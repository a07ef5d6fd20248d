"""Tests of the shared Triton kernels; ``triton_interpret`` tests run them in Triton's interpreter."""

from __future__ import annotations

from interpret_fixture import triton_interpret_env

__all__ = ["triton_interpret_env"]
