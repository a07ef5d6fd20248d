"""torch <-> JAX crossing through DLPack: no copy when the strides allow, one copy otherwise.

DLPack hands over the buffer itself; JAX (XLA) needs row-major dense buffers, so a tensor that is
not contiguous (a transposed view, a slice with a step) is made contiguous first, which is the
one copy. bfloat16 crosses as itself; a tensor that needs its gradient is detached (JAX has no
autograd tape to join).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch


def to_jax(t: torch.Tensor) -> jax.Array:
    """A jax.Array over ``t``'s memory when ``t`` is contiguous, else over a contiguous copy."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"to_jax expects a torch.Tensor, got {type(t).__name__}")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()  # the one copy: XLA buffers are dense row-major
    if t.dtype == torch.bool:
        return (
            jnp.asarray(t.numpy()) if t.device.type == "cpu" else jax.dlpack.from_dlpack(t.to(torch.uint8)).astype(bool)
        )
    return jax.dlpack.from_dlpack(t)


def to_torch(a: jax.Array) -> torch.Tensor:
    """A torch tensor over ``a``'s buffer (JAX buffers are always dense: never a copy)."""
    if not isinstance(a, jax.Array):
        raise TypeError(f"to_torch expects a jax.Array, got {type(a).__name__}")
    return torch.from_dlpack(a)
