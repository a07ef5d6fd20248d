"""Unified paged attention: prefill chunks and decodes of a varlen batch in one launch.

Grid: (query tiles, KV heads, KV segments). A program owns ``BLOCK_M`` rows: ``BLOCK_Q`` query
tokens of one sequence x the ``G`` query heads that share one KV head (GQA folded into rows, so
K/V tiles are loaded once per group, as in vLLM's ``triton_unified_attention``). It walks the keys
its rows may see (causal, within the sliding window) ``TILE_N`` at a time with an online softmax,
reading each key's page from the block table, so tiles need not align with pages.

Query tiles are numbered per sequence: sequence ``i``'s tiles start at
``query_start_loc[i] // BLOCK_Q + i`` (a binary search over ``query_start_loc`` finds a program's
sequence), which needs no host-built index and keeps the grid size a function of
``(T, B)`` only. Programs past a sequence's last tile return at once.

Split-KV (``NUM_SEGMENTS > 1``, long decodes): each program covers a segment of the keys and
writes its unnormalised accumulator, running max and sum; :func:`_reduce_segments_kernel`
merges the segments. A decode batch of a few sequences then still fills every SM.

Nothing past a sequence's length is read: every K/V load is masked by ``key < seq_len`` (the
tail of the last page and padded block-table entries may hold NaN, and ``0 * NaN`` is NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plinth_triton.kernels.lang import cdiv, row_max, row_sum, tanh


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning query tile ``tile``: the last ``i`` with qsl[i] // BLOCK_Q + i <= tile."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def unified_attention_kernel(
    q_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    out_ptr,  # [T, H, D]
    seg_acc_ptr,  # [T, H, NUM_SEGMENTS, HEAD_PAD] fp32 (split-KV only)
    seg_max_ptr,  # [T, H, NUM_SEGMENTS] fp32 (split-KV only)
    seg_sum_ptr,  # [T, H, NUM_SEGMENTS] fp32 (split-KV only)
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B+1] int32
    scale,
    soft_cap,
    window,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    PAGE: tl.constexpr,  # tokens per KV-cache block
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # BLOCK_M // GROUP
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    UPCAST: tl.constexpr,  # dot in fp32 (the interpreter's bf16 dot is wrong)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    if seq < 0:
        return
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = tile - (q_start // BLOCK_Q + seq)  # this program's tile within the sequence
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # position of the sequence's first query token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    tok = local * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] query index within the sequence
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    d_ok = offs_d < HEAD_SIZE
    q_rows = (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptr + q_rows + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, Dp]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = context + tok  # [BLOCK_M] absolute position of each row

    # Keys this tile's rows may see: [lo, hi), hi one past its last real row's position.
    hi = context + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(context + local * BLOCK_Q - window + 1, 0)
    lo = (lo // TILE_N) * TILE_N
    if NUM_SEGMENTS > 1:
        tiles_per_segment = cdiv(cdiv(hi - lo, TILE_N), NUM_SEGMENTS)
        lo = lo + segment * tiles_per_segment * TILE_N
        hi = tl.minimum(hi, lo + tiles_per_segment * TILE_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_PAD], 0.0, dtype=tl.float32)
    for start in range(lo, hi, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)  # [TILE_N] key positions
        n_ok = offs_n < seq_len
        page = tl.load(block_tables_ptr + seq * stride_bt + offs_n // PAGE, mask=n_ok, other=0)
        page = page.to(tl.int64)  # page * stride overflows int32 in a multi-GiB cache
        slot = offs_n % PAGE
        k_off = page[None, :] * stride_kb + slot[None, :] * stride_ks + kv_head * stride_kh + offs_d[:, None]
        k = tl.load(k_cache_ptr + k_off, mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [Dp, N]
        v_off = page[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
        v = tl.load(v_cache_ptr + v_off, mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [N, Dp]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:  # a KV cache narrower than the query is read in the query's dtype
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision="ieee") * scale  # [M, N] fp32
        if USE_SOFT_CAP:
            s = soft_cap * tanh(s / soft_cap)
        allowed = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if USE_WINDOW:
            allowed = allowed & (q_pos[:, None] - offs_n[None, :] < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, row_max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row with nothing seen yet: no NaN
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + row_sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    t_idx = q_start + tok
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = t_idx[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        row = (t_idx * (GROUP * tl.num_programs(1)) + head) * NUM_SEGMENTS + segment  # [M] into [T, H, S]
        tl.store(seg_max_ptr + row, m_i, mask=row_ok)
        tl.store(seg_sum_ptr + row, l_i, mask=row_ok)
        tl.store(seg_acc_ptr + row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _reduce_segments_kernel(
    out_ptr,  # [T, H, D]
    seg_acc_ptr,  # [T, H, NUM_SEGMENTS, HEAD_PAD] fp32
    seg_max_ptr,  # [T, H, NUM_SEGMENTS] fp32
    seg_sum_ptr,  # [T, H, NUM_SEGMENTS] fp32
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """Merge the segments of one (token, head): rescale each by exp(its max - the global max)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_PAD)
    base = (t * num_heads + h) * NUM_SEGMENTS
    m = tl.load(seg_max_ptr + base + offs_s)  # [S]; -inf for a segment that saw no key
    sums = tl.load(seg_sum_ptr + base + offs_s)
    acc = tl.load(seg_acc_ptr + (base + offs_s)[:, None] * HEAD_PAD + offs_d[None, :])  # [S, Dp]
    m_all = row_max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_all), 0.0)  # [S]
    total = row_sum(sums * w, 0)
    out = row_sum(acc * w[:, None], 0) / total  # [Dp]
    o_ptr = out_ptr + t * stride_ot + h * stride_oh + offs_d
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_SIZE)


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_tokens: int,
    scale: float,
    *,
    sliding_window: int | None,
    soft_cap: float | None,
    block_m: int,
    tile_n: int,
    num_segments: int,
    upcast: bool,
    launch: dict[str, int],
) -> None:
    """Launch the kernel(s) over ``num_tokens`` real query tokens (``query_start_loc[-1]``).

    ``query``/``out`` [T, H, D] with unit stride in D; ``key_cache``/``value_cache``
    [num_blocks, block_size, Hkv, D] with unit stride in D. ``num_segments > 1`` takes the
    split-KV path (meant for pure-decode batches). ``launch``: num_warps, num_stages, ...
    """
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads, page = key_cache.shape[2], key_cache.shape[1]
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    head_pad = max(16, triton.next_power_of_2(head_size))
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    if num_segments > 1:
        seg_acc = torch.empty(num_tokens, num_heads, num_segments, head_pad, dtype=torch.float32, device=out.device)
        seg_max = torch.empty(num_tokens, num_heads, num_segments, dtype=torch.float32, device=out.device)
        seg_sum = torch.empty_like(seg_max)
    else:  # never touched: the split-KV stores are compiled out
        seg_acc = seg_max = seg_sum = out
    unified_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        seg_acc,
        seg_max,
        seg_sum,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        1.0 if soft_cap is None else soft_cap,
        0 if sliding_window is None else sliding_window,
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        PAGE=page,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=soft_cap is not None,
        NUM_SEGMENTS=num_segments,
        UPCAST=upcast,
        **launch,
    )
    if num_segments > 1:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out,
            seg_acc,
            seg_max,
            seg_sum,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            NUM_SEGMENTS=num_segments,
            num_warps=launch.get("num_warps", 4),
        )
