"""Fused mixture-of-experts: a grouped GEMM over the step's (token, expert) slots sorted by expert.

The ``T * k`` slots (token ``t``'s ``j``-th choice is slot ``t * k + j``) are sorted by expert and
each expert's run is padded up to a multiple of ``BLOCK_M`` with the sentinel ``T * k``
(:func:`align_by_expert`, in torch on the device: no host sync, the grid is sized by the upper
bound ``cdiv(T * k, BLOCK_M) + E`` and blocks past the padded total return at once). Every
block of ``BLOCK_M`` sorted slots then belongs to one expert, so one program computes an
``[BLOCK_M, BLOCK_N]`` tile of that expert's product with ``tl.dot`` and the expert's weight
tile is read once per block, not once per token.

Two launches of :func:`moe_gemm_kernel`:

1. gate/up, ``GATED``: rows ``x[slot // k]``, two accumulators over the gate rows ``n`` and the
   up rows ``n + I`` of ``gate_up[e]`` [2I, H], the activation ``act(gate) * up`` applied in fp32
   in the epilogue: ``h`` [T * k, I] in the compute dtype, row = slot;
2. down: rows ``h[slot]`` times ``down[e]`` [H, I], scaled by the slot's routing weight:
   ``y`` [T * k, H] in fp32, row = slot.

The token's output is ``y.view(T, k, H).sum(1)``: a fixed order, no atomics, so a second call
gives the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plinth_triton.kernels.lang import tanh

#: ``ACT`` codes of :func:`moe_gemm_kernel`.
ACTIVATION_CODES: dict[str, int] = {"silu": 0, "gelu_tanh": 1}


@triton.jit
def moe_gemm_kernel(
    a_ptr,  # [rows, K]: x [T, H] (ROW_DIV = k) or h [T * k, I] (ROW_DIV = 1)
    b_ptr,  # [E, N (x2 if GATED), K]
    out_ptr,  # [T * k, N]
    weight_ptr,  # [T * k] fp32 routing weight per slot (MUL_WEIGHT only)
    sorted_ids_ptr,  # [padded] slot ids grouped by expert, sentinel num_slots
    block_expert_ptr,  # [blocks] the expert of each BLOCK_M block
    total_ptr,  # [1] padded length actually used
    N,
    K,
    num_slots,
    gate_offset,  # I: the up rows follow the gate rows (GATED only)
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_om,
    ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    ACT: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in fp32 (the interpreter's bf16 dot is wrong)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return  # past the padded total: the grid is sized by its upper bound
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slots = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    row_ok = slots < num_slots
    rows = slots // ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    b_base = b_ptr + expert * stride_be
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    acc_up = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BM, BK]
        w_mask = k_ok[:, None] & n_ok[None, :]
        w = tl.load(
            b_base + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk, mask=w_mask, other=0.0
        )  # [BK, BN]: the expert's rows read transposed
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype), input_precision="ieee")
        if GATED:
            w_up = tl.load(
                b_base + (offs_n + gate_offset)[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                mask=w_mask,
                other=0.0,
            )  # [BK, BN]
            if UPCAST:
                acc_up += tl.dot(a.to(tl.float32), w_up.to(tl.float32), input_precision="ieee")
            else:
                acc_up += tl.dot(a, w_up.to(a.dtype), input_precision="ieee")
    if GATED:
        if ACT == 0:  # silu(g) = g * sigmoid(g)
            gated = acc / (1.0 + tl.exp(-acc))
        else:  # gelu, tanh approximation
            gated = 0.5 * acc * (1.0 + tanh(0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)))
        acc = gated * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + slots, mask=row_ok, other=0.0)[:, None]
    out_off = slots.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptr + out_off, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids`` [T, k] -> (sorted slot ids [P], expert per block [P / block_m], padded total [1]).

    ``P = (cdiv(T * k, block_m) + E) * block_m`` bounds the padded length: each expert adds at
    most one partial block. Entries past an expert's run, and past the total, hold the sentinel
    ``T * k``. All on ``ids``' device, without reading anything back.
    """
    flat = ids.flatten()  # [S], S = T * k
    slots = flat.numel()
    device = flat.device
    # [E]; not torch.bincount, which reads the largest id back to the host to size its output
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    run_start = torch.cumsum(counts, 0) - counts  # [E]: where each expert's slots start, unpadded
    order = torch.argsort(flat, stable=True)  # [S]
    expert_of = flat[order]  # [S]
    rank = torch.arange(slots, device=device) - run_start[expert_of]  # position inside its run
    dest = (padded_end - padded)[expert_of] + rank  # [S]
    blocks = triton.cdiv(slots, block_m) + num_experts
    sorted_ids = torch.full((blocks * block_m,), slots, dtype=torch.int64, device=device)
    sorted_ids[dest] = order
    block_start = torch.arange(blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True).clamp_max(num_experts - 1)
    return sorted_ids, block_expert, padded_end[-1:].clone()


def fused_moe(
    x: torch.Tensor,
    route_w: torch.Tensor,
    route_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    activation: str,
    block_m: int,
    tiles_up: tuple[int, int],
    tiles_down: tuple[int, int],
    upcast: bool,
    launch: dict[str, int],
) -> torch.Tensor:
    """``x`` [T, H] (any strides), routing [T, k] -> [T, H] in ``x``'s dtype, for ``gate_up``
    [E, 2I, H] and ``down`` [E, H, I] contiguous in ``x``'s dtype; ``tiles_up`` / ``tiles_down``
    are the ``(BLOCK_N, BLOCK_K)`` of the two launches."""
    t, hidden = x.shape
    num_experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    k = route_ids.shape[1]
    slots = t * k
    if slots == 0:
        return torch.zeros(t, hidden, dtype=x.dtype, device=x.device)
    sorted_ids, block_expert, total = align_by_expert(route_ids, num_experts, block_m)
    slot_w = route_w.reshape(-1).to(torch.float32).contiguous()  # [S]
    h = torch.empty(slots, inter, dtype=x.dtype, device=x.device)  # [S, I]
    y = torch.empty(slots, hidden, dtype=torch.float32, device=x.device)  # [S, H]
    blocks = block_expert.numel()
    common = {"BLOCK_M": block_m, "UPCAST": upcast, **launch}
    (up_n, up_k), (down_n, down_k) = tiles_up, tiles_down
    moe_gemm_kernel[(blocks, triton.cdiv(inter, up_n))](
        x, gate_up, h, slot_w, sorted_ids, block_expert, total,
        inter, hidden, slots, inter,
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), h.stride(0),
        ROW_DIV=k, GATED=True, ACT=ACTIVATION_CODES[activation], MUL_WEIGHT=False,
        BLOCK_N=up_n, BLOCK_K=up_k, **common,
    )  # fmt: skip
    moe_gemm_kernel[(blocks, triton.cdiv(hidden, down_n))](
        h, down, y, slot_w, sorted_ids, block_expert, total,
        hidden, inter, slots, 0,
        h.stride(0), h.stride(1), down.stride(0), down.stride(1), down.stride(2), y.stride(0),
        ROW_DIV=1, GATED=False, ACT=0, MUL_WEIGHT=True,
        BLOCK_N=down_n, BLOCK_K=down_k, **common,
    )  # fmt: skip
    return y.view(t, k, hidden).sum(dim=1).to(x.dtype)
