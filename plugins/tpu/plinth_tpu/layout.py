"""The TPU backend's KV-cache layout: K and V interleaved per head, heads packed, lanes padded.

One layer's cache is ``[num_blocks, block_size, 2 * Hkv // packing, packing, Dp]``:

- combined head ``2h`` is the K of kv head ``h`` and ``2h + 1`` its V, so one page fetch brings
  both halves of a head;
- ``packing = 4 // itemsize`` combined heads share one 32-bit word column (1 for float32, 2 for
  bfloat16): on TPU the two minor dims ``(packing, Dp)`` of a 16-bit array fill one dense
  ``(packing, 128)`` tile, so a page is stored without sublane padding;
- ``Dp`` is the head size rounded up to 128, the TPU lane width, zero padded: a head of 64 or 80
  lanes still loads as whole vregs.

Combined head ``c`` lives at ``[..., c // packing, c % packing, :]``. The helpers here convert
between that layout and the plain ``[num_blocks, block_size, Hkv, D]`` K/V pair the reference
kernels read; tests and the backend's ``copy_blocks`` use them, the kernels index the layout directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

LANES = 128  # TPU vector lane width: the minor dim of every vreg


def kv_packing(dtype: DTypeLike) -> int:
    """How many combined heads share one 32-bit column: 1 for 32-bit, 2 for 16-bit dtypes."""
    itemsize = jnp.dtype(dtype).itemsize
    if itemsize not in (1, 2, 4):
        raise ValueError(
            f"KV-cache dtype {jnp.dtype(dtype).name} has itemsize {itemsize}; the TPU layout packs 1, 2 or 4 bytes"
        )
    return 4 // itemsize


def padded_head_size(head_size: int) -> int:
    """The physical head size: ``head_size`` rounded up to the 128-lane width."""
    if head_size <= 0:
        raise ValueError(f"head_size must be positive, got {head_size}")
    return -(-head_size // LANES) * LANES


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: DTypeLike
) -> tuple[int, int, int, int, int]:
    """Shape of one layer's KV cache: ``[num_blocks, block_size, 2*Hkv // packing, packing, Dp]``.

    :raises ValueError: a non-positive size, or ``2 * num_kv_heads`` not divisible by the packing
        (an odd head count cannot pair K/V words of a 8-bit cache).
    """
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    packing = kv_packing(dtype)
    if (2 * num_kv_heads) % packing:
        raise ValueError(
            f"2 * num_kv_heads = {2 * num_kv_heads} is not divisible by the packing {packing} of {jnp.dtype(dtype)}"
        )
    return (num_blocks, block_size, 2 * num_kv_heads // packing, packing, padded_head_size(head_size))


def empty_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: DTypeLike) -> jax.Array:
    """A zeroed cache of :func:`kv_cache_shape`."""
    return jnp.zeros(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, dtype), dtype)


def interleave_kv(key: jax.Array, value: jax.Array, packing: int) -> jax.Array:
    """``[..., Hkv, D]`` K and V -> ``[..., 2*Hkv // packing, packing, Dp]`` rows of the layout."""
    if key.shape != value.shape:
        raise ValueError(f"key {key.shape} and value {value.shape} differ in shape")
    *lead, hkv, d = key.shape
    dp = padded_head_size(d)
    kv = jnp.stack([key, value], axis=-2).reshape(*lead, 2 * hkv, d)  # [..., 2Hkv, D]: K_h at 2h, V_h at 2h+1
    if dp != d:
        kv = jnp.pad(kv, [(0, 0)] * (kv.ndim - 1) + [(0, dp - d)])
    return kv.reshape(*lead, 2 * hkv // packing, packing, dp)


def split_kv(rows: jax.Array, head_size: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`interleave_kv`: layout rows -> K and V ``[..., Hkv, head_size]``."""
    *lead, rows_per_token, packing, dp = rows.shape
    if head_size > dp:
        raise ValueError(f"head_size {head_size} exceeds the physical head size {dp}")
    combined = rows.reshape(*lead, rows_per_token * packing, dp)[..., :head_size]
    return combined[..., 0::2, :], combined[..., 1::2, :]


def gather_kv(cache: jax.Array, head_size: int) -> tuple[jax.Array, jax.Array]:
    """The whole cache as plain K and V, each ``[num_blocks, block_size, Hkv, head_size]``."""
    if cache.ndim != 5:
        raise ValueError(
            f"expected a 5-d TPU KV cache [blocks, block_size, 2Hkv/packing, packing, Dp], got shape {cache.shape}"
        )
    return split_kv(cache, head_size)


def from_plain_kv(key_cache: jax.Array, value_cache: jax.Array) -> jax.Array:
    """Plain ``[num_blocks, block_size, Hkv, D]`` K and V caches -> one cache in this layout."""
    return interleave_kv(key_cache, value_cache, kv_packing(key_cache.dtype))
