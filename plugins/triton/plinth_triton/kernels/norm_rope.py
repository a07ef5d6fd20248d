"""RMSNorm (optionally fused with the residual add) and NeoX rotary embedding.

Both compute in fp32 and round once on store, and both write a new tensor: callers (and the
conformance suite) still hold their inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plinth_triton.kernels.lang import row_sum


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [R, H]
    residual_ptr,  # [R, H] (HAS_RESIDUAL only): x + residual is normalised and written back here
    weight_ptr,  # [H]
    out_ptr,  # [R, H]
    num_rows,
    stride_x,
    stride_r,
    stride_o,
    eps,
    HIDDEN: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    cols = tl.arange(0, HIDDEN_PAD)
    mask = (rows < num_rows)[:, None] & (cols < HIDDEN)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_off = rows[:, None] * stride_r + cols[None, :]
        x = x + tl.load(residual_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_ptr + r_off, x.to(residual_ptr.dtype.element_ty), mask=mask)
    inv_rms = 1.0 / tl.sqrt(row_sum(x * x, 1) / HIDDEN + eps)  # [BR]; padded columns add 0
    w = tl.load(weight_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
    out = x * inv_rms[:, None] * w[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    x_ptr,  # [T, H, D]
    pos_ptr,  # [T] int64
    cos_sin_ptr,  # [max_pos, ROT]: cos in the first ROT/2 columns, sin in the rest
    out_ptr,  # [T, H, D] contiguous
    num_heads,
    stride_xt,
    stride_xh,
    stride_cs,
    HEAD_SIZE: tl.constexpr,
    ROT: tl.constexpr,  # rotary_dim
    HALF_PAD: tl.constexpr,
    REST_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE - ROT (>= 1)
    HEADS_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    heads = tl.arange(0, HEADS_PAD)
    half = tl.arange(0, HALF_PAD)
    h_ok = heads < num_heads
    mask = h_ok[:, None] & (half < ROT // 2)[None, :]
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + half, mask=half < ROT // 2, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + ROT // 2 + half, mask=half < ROT // 2, other=0.0).to(tl.float32)
    base = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    x1 = tl.load(base + half[None, :], mask=mask, other=0.0).to(tl.float32)  # [Hp, R/2]
    x2 = tl.load(base + ROT // 2 + half[None, :], mask=mask, other=0.0).to(tl.float32)
    # NeoX "rotate half": (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
    o_base = out_ptr + t * num_heads * HEAD_SIZE + heads[:, None] * HEAD_SIZE
    dtype = out_ptr.dtype.element_ty
    tl.store(o_base + half[None, :], (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype), mask=mask)
    tl.store(o_base + ROT // 2 + half[None, :], (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype), mask=mask)
    if ROT < HEAD_SIZE:  # partial rotary: the remaining features pass through
        rest = ROT + tl.arange(0, REST_PAD)
        r_mask = h_ok[:, None] & (rest < HEAD_SIZE)[None, :]
        tl.store(o_base + rest[None, :], tl.load(base + rest[None, :], mask=r_mask), mask=r_mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    *,
    block_r: int,
    launch: dict[str, int],
) -> torch.Tensor:
    """RMSNorm of ``x`` [..., H] (of ``x + residual``, stored into ``residual``, when given)."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res = None if residual is None else residual.view(-1, hidden)  # written in place: must be a view
    rows = x2.shape[0]
    if rows:
        rms_norm_kernel[(triton.cdiv(rows, block_r),)](
            x2,
            out if res is None else res,
            weight,
            out,
            rows,
            x2.stride(0),
            0 if res is None else res.stride(0),
            out.stride(0),
            eps,
            HIDDEN=hidden,
            HIDDEN_PAD=triton.next_power_of_2(hidden),
            BLOCK_R=block_r,
            HAS_RESIDUAL=res is not None,
            **launch,
        )
    return out.view(x.shape)


def rotary(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int, *, launch: dict[str, int]
) -> torch.Tensor:
    """NeoX rotary of ``x`` [T, H, D] (last-dim stride 1) at ``positions`` [T] -> a new [T, H, D]."""
    num_tokens, num_heads, head_size = x.shape
    out = torch.empty((num_tokens, num_heads, head_size), dtype=x.dtype, device=x.device)
    if num_tokens:
        rotary_kernel[(num_tokens,)](
            x,
            positions,
            cos_sin,
            out,
            num_heads,
            x.stride(0),
            x.stride(1),
            cos_sin.stride(0),
            HEAD_SIZE=head_size,
            ROT=rotary_dim,
            HALF_PAD=triton.next_power_of_2(max(rotary_dim // 2, 1)),
            REST_PAD=triton.next_power_of_2(max(head_size - rotary_dim, 1)),
            HEADS_PAD=triton.next_power_of_2(num_heads),
            **launch,
        )
    return out
