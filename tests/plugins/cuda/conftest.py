"""``triton_interpret`` tests here run the backend's kernels in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "triton"))  # the shared fixture and batch builders

from interpret_fixture import triton_interpret_env  # noqa: E402

__all__ = ["triton_interpret_env"]
