"""GEMM ``out = x @ w.T (+ bias)``: dense fp32/bf16/fp16, or weight-only int8 / int4 dequantized in-kernel.

Grid: (M tiles x N tiles,), in grouped order (``GROUP_M`` M-tiles walk the same N-tiles in turn,
so a weight tile is reused from L2 while it is hot). Every load is masked, so M, N and K need not
be multiples of the tile (33 x 255 x 513 works); ``x`` and ``w`` may have any strides.

Weight formats (``QUANT``):

* 0, dense: ``w`` [N, K] in the activation dtype.
* 1, int8 per output channel: ``w`` [N, K] int8, ``scale`` [N] fp32; ``w_real = w * scale[n]``.
  The scale is constant along K, so it is applied once to the accumulator instead of to every
  weight element (the product is the same up to rounding).
* 2, int4 with group scales: ``w`` [N, ceil(K/2)] uint8, two weights per byte (even k in the low
  nibble), stored as ``q + 8`` for ``q`` in [-8, 7]; ``scale`` [N, ceil(K/GROUP)] fp32;
  ``w_real = q * scale[n, k // GROUP]``. Unpacked and scaled per tile, then fed to ``tl.dot``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plinth_triton.kernels.lang import cdiv


@triton.jit
def gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] (dense, int8) or [N, ceil(K/2)] uint8 (int4)
    scale_ptr,  # [N] or [N, ceil(K/GROUP)] fp32 (quantized formats only)
    bias_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_om,
    QUANT: tl.constexpr,
    QUANT_GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in fp32 (the interpreter's bf16 dot is wrong)
):
    pid = tl.program_id(0)
    tiles_m = cdiv(M, BLOCK_M)
    tiles_n = cdiv(N, BLOCK_N)
    # Grouped ordering: consecutive programs share N-tiles of the weight.
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BM, BK]
        w_mask = k_ok[:, None] & n_ok[None, :]
        if QUANT == 2:
            packed = tl.load(
                w_ptr + offs_n[None, :] * stride_wn + (offs_k // 2)[:, None] * stride_wk, mask=w_mask, other=0
            )  # [BK, BN] uint8, each byte read for its two nibbles
            nibble = (packed.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 0xF
            s = tl.load(
                scale_ptr + offs_n[None, :] * stride_sn + (offs_k // QUANT_GROUP)[:, None], mask=w_mask, other=0.0
            )  # [BK, BN]
            w = (nibble - 8).to(tl.float32) * s
        else:
            w = tl.load(
                w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0
            )  # [BK, BN]: the weight read transposed
        if UPCAST:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
    if QUANT == 1:
        acc = acc * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_off = offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    *,
    quant: int,
    scale: torch.Tensor | None,
    quant_group: int,
    in_features: int,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int,
    upcast: bool,
    launch: dict[str, int],
) -> torch.Tensor:
    """``out`` [M, N] = ``x`` [M, K] @ dequant(``weight``).T (+ ``bias``); returns ``out``."""
    m, n = out.shape
    if m == 0:
        return out
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    gemm_kernel[grid](
        x,
        weight,
        out if scale is None else scale,  # placeholder pointers are never read
        out if bias is None else bias,
        out,
        m,
        n,
        in_features,
        x.stride(0),
        x.stride(1),
        weight.stride(0),
        weight.stride(1),
        0 if scale is None else scale.stride(0),
        out.stride(0),
        QUANT=quant,
        QUANT_GROUP=quant_group,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUP_M=group_m,
        UPCAST=upcast,
        **launch,
    )
    return out
