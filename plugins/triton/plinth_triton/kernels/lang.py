"""The few standard-library ops the kernels need, defined so the interpreter runs them in any process.

Why: ``tl.sum``, ``tl.max``, ``tl.cdiv``, ``tl.sigmoid`` and ``tl.zeros`` are themselves
``@triton.jit`` functions, decorated when triton is first imported. If anything imported triton
before ``TRITON_INTERPRET=1`` was set (torch and transformers do, on import), they are compiled-mode
functions that an interpreted kernel cannot call. These helpers are decorated when this module is
imported (after ``plinth_triton.runtime`` set the variable), and the reductions pass the standard
combine functions by identity, which the interpreter maps to numpy and the compiler inlines.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language import standard as _std


@triton.jit
def row_sum(x, axis: tl.constexpr):
    """``tl.sum(x, axis)`` for fp32 ``x``."""
    return tl.reduce(x, axis, _std._sum_combine)


@triton.jit
def row_max(x, axis: tl.constexpr):
    """``tl.max(x, axis)``."""
    return tl.reduce(x, axis, _std._elementwise_max)


@triton.jit
def cdiv(x, div):
    """Ceiling division of non-negative integers."""
    return (x + div - 1) // div


@triton.jit
def tanh(x):
    """tanh through exp, for the soft cap: tl has no tanh that works on every backend.

    Written as 1 - 2 / (exp(2x) + 1), which saturates cleanly to +-1 when exp overflows to inf
    or underflows to 0.
    """
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
