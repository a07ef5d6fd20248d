"""Where the Triton kernels run: on a GPU, or in Triton's interpreter on CPU tensors (CI).

Nothing here imports triton at module level: the CUDA and ROCm plugins import this module on every
machine, and a machine without triton must still load them (their probes then say what is
missing). Kernel modules (``plinth_triton.kernels.*``) import triton and are imported lazily, only
once a backend has been selected.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

#: Set to 1 to run the cuda/rocm backends' kernels in Triton's interpreter on CPU tensors.
INTERPRET_ENV = "PLINTH_TRITON_INTERPRET"


def interpret_requested() -> bool:
    """True when ``PLINTH_TRITON_INTERPRET=1``; also sets ``TRITON_INTERPRET=1`` for triton.

    Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when a kernel module is
    first imported, so it is set here, before any of them is.
    """
    if os.environ.get(INTERPRET_ENV, "") != "1":
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


@dataclass(frozen=True, slots=True)
class TritonStatus:
    """Whether triton imports, and its version or the import error."""

    available: bool
    detail: str  # "triton 3.6.0", or why it is not usable


@functools.cache
def triton_status() -> TritonStatus:
    """Import triton once and report; never raises."""
    try:
        import triton
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        return TritonStatus(False, f"triton is not importable ({type(exc).__name__}: {exc})")
    return TritonStatus(True, f"triton {triton.__version__}")


def interpreting() -> bool:
    """True when kernels run in the interpreter (the environment says so)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1" or interpret_requested()
