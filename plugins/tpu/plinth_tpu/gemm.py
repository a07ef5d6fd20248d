"""GEMMs in ``jax.numpy``: XLA tiles them onto the MXU itself, so no Pallas kernel is needed.

- dense: ``x @ w.T + b``, float32, or bfloat16 inputs with float32 accumulation;
- int8 weight-only: weights quantized once at prepare (symmetric, one scale per output channel),
  ``(x @ w_int8.T) * scale + b`` with the int8 -> compute-dtype conversion inside the matmul's
  fusion (XLA fuses the convert into the dot's operand read, so the int8 bytes are what HBM sends).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import DTypeLike

_SUPPORTED = ("float32", "bfloat16")


def _check_dtype(dtype: DTypeLike) -> jnp.dtype:
    dt = jnp.dtype(dtype)
    if dt.name not in _SUPPORTED:
        raise ValueError(f"GEMM compute dtype {dt.name} is not supported; use one of {_SUPPORTED}")
    return dt


def _matmul_t(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [..., K] @ w[N, K].T`` accumulated in float32, without materialising ``w.T``."""
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {w.shape} has {w.shape[1]}")
    return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


@jax.tree_util.register_dataclass  # a pytree: prepared weights are arguments of jitted steps
@dataclass(frozen=True, slots=True)
class DenseWeight:
    """A prepared dense weight: ``weight [N, K]`` and ``bias [N]`` in the compute dtype."""

    weight: jax.Array
    bias: jax.Array | None


def prepare_dense(weight: jax.Array, bias: jax.Array | None, dtype: DTypeLike) -> DenseWeight:
    """Cast once at load time to the compute dtype."""
    dt = _check_dtype(dtype)
    if weight.ndim != 2:
        raise ValueError(f"a linear weight must be [out_features, in_features], got {weight.shape}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {bias.shape} does not match {weight.shape[0]} output features")
    return DenseWeight(weight.astype(dt), None if bias is None else bias.astype(dt))


def dense_linear(x: jax.Array, w: DenseWeight) -> jax.Array:
    """``x @ w.T + b`` in the weight's dtype, accumulated (and biased) in float32."""
    out = _matmul_t(x.astype(w.weight.dtype), w.weight)
    if w.bias is not None:
        out = out + w.bias.astype(jnp.float32)
    return out.astype(w.weight.dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["weight", "scale", "bias"], meta_fields=["dtype"])
@dataclass(frozen=True, slots=True)
class Int8Weight:
    """``weight_int8 [N, K]``, ``scale [N]`` float32 (w ~ weight_int8 * scale), bias, compute dtype."""

    weight: jax.Array
    scale: jax.Array
    bias: jax.Array | None
    dtype: jnp.dtype


def quantize_int8(weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric per-output-channel int8: ``scale = max|w_row| / 127``, ``q = round(w / scale)``.

    An all-zero row gets scale 1 (its codes are 0 anyway), never a division by zero.
    """
    w = weight.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w / scale[:, None]), -127, 127).astype(jnp.int8)
    return q, scale


def prepare_int8(weight: jax.Array, bias: jax.Array | None, dtype: DTypeLike) -> Int8Weight:
    """Quantize at prepare time; ``dtype`` is the activations' compute dtype."""
    dt = _check_dtype(dtype)
    if weight.ndim != 2:
        raise ValueError(f"a linear weight must be [out_features, in_features], got {weight.shape}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {bias.shape} does not match {weight.shape[0]} output features")
    q, scale = quantize_int8(weight)
    return Int8Weight(q, scale, None if bias is None else bias.astype(jnp.float32), dt)


def int8_linear(x: jax.Array, w: Int8Weight) -> jax.Array:
    """``(x @ w_int8.T) * scale + b``: int8 codes converted to the compute dtype inside the dot."""
    out = _matmul_t(x.astype(w.dtype), w.weight.astype(w.dtype)) * w.scale
    if w.bias is not None:
        out = out + w.bias
    return out.astype(w.dtype)
