"""KV-cache write: scatter the step's keys and values to their slots (``slot < 0``: padding, skipped).

Grid: (token tiles,). A program copies ``BLOCK_T`` tokens x all ``Hkv * D`` features of K and V
(one flattened feature axis, so any head count and head size fit one tile shape). Inputs may be
strided views of a fused QKV projection; the cache is ``[num_blocks, block_size, Hkv, D]`` per
half with any strides. Values are copied bit for bit: a dtype conversion, if any, is done by torch
before the launch (so rounding is torch's, the same as every other backend's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    slot_ptr,  # [T] int64
    num_tokens,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    HEAD_SIZE: tl.constexpr,
    FEATURES: tl.constexpr,  # Hkv * D
    FEATURES_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    offs_f = tl.arange(0, FEATURES_PAD)  # [Fp]
    slot = tl.load(slot_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    head = offs_f // HEAD_SIZE
    dim = offs_f % HEAD_SIZE
    mask = (slot >= 0)[:, None] & (offs_f < FEATURES)[None, :]
    page = tl.where(slot >= 0, slot // PAGE, 0)
    dst = (page * stride_cb + (slot % PAGE) * stride_cs)[:, None] + (head * stride_ch + dim * stride_cd)[None, :]
    tok = offs_t.to(tl.int64)[:, None]
    k = tl.load(key_ptr + tok * stride_kt + (head * stride_kh + dim * stride_kd)[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + (head * stride_vh + dim * stride_vd)[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    block_t: int,
    launch: dict[str, int],
) -> None:
    """Store ``key``/``value`` [T, Hkv, D] into the caches [num_blocks, block_size, Hkv, D]."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    if key.dtype != key_cache.dtype:  # torch's rounding, like every other backend
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    features = num_kv_heads * head_size
    write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        HEAD_SIZE=head_size,
        FEATURES=features,
        FEATURES_PAD=triton.next_power_of_2(features),
        PAGE=key_cache.shape[1],
        BLOCK_T=block_t,
        **launch,
    )
