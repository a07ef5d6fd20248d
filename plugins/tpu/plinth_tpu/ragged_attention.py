"""Ragged paged attention in Pallas: one call for a varlen batch of prefill chunks and decodes.

The call writes the step's new K/V into the cache and attends over it, returning the output and
the updated cache (JAX arrays are immutable: under ``jax.jit`` with the cache donated, XLA does
the write in place).

How it is cut into work (all shapes static, so one compile serves a bucket):

1. KV write: one XLA scatter of the new tokens' interleaved K/V rows into the flattened cache;
   padding tokens (slot -1) scatter out of bounds and are dropped.
2. Two passes of one Pallas kernel, chosen by ``distribution = (d, d+p, n)``:
   a *decode pass* with a query tile of one token for sequences ``[0, d)``, and a *prefill pass*
   with tiles of ``q_tile`` tokens for sequences ``[d, n)`` (fresh prefills and chunks after
   cached context alike; a chunk only differs by where its first query sits). Each pass runs a
   grid ``(tiles, pages)``: a tile is up to ``q_tile`` query tokens of ONE sequence, all heads;
   the page axis walks the sequence's block table (scalar-prefetched), clamped to the pages the
   tile can see (causal end, sliding-window start), so a page outside that range is neither
   fetched again nor computed.
3. Inside the kernel, per kv head: ``s = q @ k.T`` on the MXU in float32, optional soft-cap,
   causal/window mask, then an online softmax (running maximum, running sum, rescaled
   accumulator in VMEM scratch) across pages.

Tile rows are ordered ``g * q_tile + t`` (query head ``g`` of the kv head's group, token ``t``),
so a whole GQA group shares one matmul with its kv head, and ``t = row & (q_tile - 1)`` needs no
vector division (``q_tile`` is a power of two).

Mosaic rules kept: every block's last two dims are the array's own (full) dims or multiples of
(8, 128); block tables, lengths and the tile plan are scalar-prefetched into SMEM; no ref is
reshaped inside the kernel (jax 0.10.2's interpreter cannot discharge a reshaped ref), only
values are.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from plinth_tpu.layout import interleave_kv, kv_cache_shape, kv_packing

# Finite, so a fully masked row gives exp(MASK - MASK) = 1 rather than inf - inf = NaN; masked
# probabilities are zeroed explicitly anyway.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
DEFAULT_Q_TILE = 16
_STAT_LANES = 128  # running max / sum kept lane-replicated: (rows, 128) is one dense vreg column


@dataclass(frozen=True, slots=True)
class _TilePlan:
    """Which query tokens each grid tile of one pass covers (int32 arrays, one entry a tile)."""

    seq: jax.Array  # [N] the sequence the tile belongs to
    pos0: jax.Array  # [N] kv position of the tile's first query token
    rows: jax.Array  # [N] real tokens in the tile (0: an idle tile)
    tok0: jax.Array  # [N] index into the step's T tokens of the tile's first query token


def _decode_plan(query_start_loc: jax.Array, seq_lens: jax.Array, distribution: jax.Array) -> _TilePlan:
    """One single-token tile per sequence slot; slots ``>= d`` idle."""
    num_seqs = seq_lens.shape[0]
    idx = jnp.arange(num_seqs, dtype=jnp.int32)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    active = (idx < distribution[0]) & (idx < distribution[2]) & (q_lens > 0) & (seq_lens > 0)
    return _TilePlan(
        seq=idx,
        pos0=jnp.maximum(seq_lens - 1, 0),
        rows=active.astype(jnp.int32),
        tok0=query_start_loc[:-1],
    )


def _prefill_tiles_bound(num_tokens: int, num_seqs: int, q_tile: int) -> int:
    """Static upper bound on the prefill pass's tiles: sum_i ceil(q_i / q_tile) with sum q_i <= T."""
    seqs = min(num_seqs, num_tokens)
    return max(1, (num_tokens + seqs * (q_tile - 1)) // q_tile)


def _prefill_plan(
    query_start_loc: jax.Array, seq_lens: jax.Array, distribution: jax.Array, num_tokens: int, q_tile: int
) -> _TilePlan:
    """Sequences ``[d, n)`` cut into tiles of ``q_tile`` query tokens, packed from tile 0."""
    num_seqs = seq_lens.shape[0]
    idx = jnp.arange(num_seqs, dtype=jnp.int32)
    in_pass = (idx >= distribution[0]) & (idx < distribution[2]) & (seq_lens > 0)
    q_lens = jnp.where(in_pass, query_start_loc[1:] - query_start_loc[:-1], 0)
    tiles_per_seq = (q_lens + q_tile - 1) // q_tile
    ends = jnp.cumsum(tiles_per_seq)  # [B] inclusive: sequence i owns tiles [ends[i]-n_i, ends[i])
    t = jnp.arange(_prefill_tiles_bound(num_tokens, num_seqs, q_tile), dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, t, side="right"), num_seqs - 1).astype(jnp.int32)
    q0 = (t - (ends[seq] - tiles_per_seq[seq])) * q_tile  # first query of the tile within its sequence
    valid = t < ends[-1]
    return _TilePlan(
        seq=seq,
        pos0=jnp.where(valid, seq_lens[seq] - q_lens[seq] + q0, 0),
        rows=jnp.where(valid, jnp.minimum(q_tile, q_lens[seq] - q0), 0),
        tok0=jnp.where(valid, query_start_loc[seq] + q0, 0),
    )


def _page_range(
    tile: jax.Array,
    seq_ref: jax.Array,
    pos0_ref: jax.Array,
    rows_ref: jax.Array,
    *,
    block_size: int,
    sliding_window: int | None,
) -> tuple[jax.Array, jax.Array]:
    """First and last page (inclusive) of its sequence that tile ``tile`` attends to (scalars)."""
    pos0 = pos0_ref[tile]
    rows = rows_ref[tile]
    # lax.div, not //: the operands are >= 0, and jnp's floor division lowers a sign fix-up whose
    # Mosaic rule asks the *default* device for its TPU generation (fails when compiling ahead of time)
    last = lax.div(jnp.maximum(pos0 + rows - 1, 0), block_size)  # causal: nothing past the tile's last query
    if sliding_window is None:
        first = jnp.int32(0)
    else:
        first = jnp.minimum(lax.div(jnp.maximum(pos0 - sliding_window + 1, 0), block_size), last)
    return first, last


def _attention_kernel(
    # scalar prefetch (SMEM)
    block_tables_ref: jax.Array,  # [B * W] flattened
    seq_lens_ref: jax.Array,  # [B]
    seq_ref: jax.Array,  # [N]
    pos0_ref: jax.Array,  # [N]
    rows_ref: jax.Array,  # [N]
    # blocks (VMEM)
    q_ref: jax.Array,  # [Hkv, G*Tq, Dp]
    kv_ref: jax.Array,  # [bs, 2Hkv/packing, packing, Dp]: one page
    o_ref: jax.Array,  # [Hkv, G*Tq, Dp]
    # scratch (VMEM)
    m_ref: jax.Array,  # [Hkv, G*Tq, 128] running max
    l_ref: jax.Array,  # [Hkv, G*Tq, 128] running sum
    acc_ref: jax.Array,  # [Hkv, G*Tq, Dp] running numerator
    *,
    block_size: int,
    num_kv_heads: int,
    q_tile: int,
    packing: int,
    sliding_window: int | None,
    soft_cap: float | None,
) -> None:
    tile, page = pl.program_id(0), pl.program_id(1)
    num_pages = pl.num_programs(1)
    rows = rows_ref[tile]
    pos0 = pos0_ref[tile]
    first, last = _page_range(tile, seq_ref, pos0_ref, rows_ref, block_size=block_size, sliding_window=sliding_window)
    seq_len = seq_lens_ref[seq_ref[tile]]

    @pl.when(page == 0)
    def _init() -> None:
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((rows > 0) & (page >= first) & (page <= last))
    def _accumulate() -> None:
        num_rows = q_ref.shape[1]
        # q_pos[r]: kv position of row r's token; rows past the tile's real tokens are masked whole
        t_of_row = lax.broadcasted_iota(jnp.int32, (num_rows, block_size), 0) & (q_tile - 1)
        q_pos = pos0 + t_of_row
        k_pos = page * block_size + lax.broadcasted_iota(jnp.int32, (num_rows, block_size), 1)
        allowed = (k_pos <= q_pos) & (k_pos < seq_len) & (t_of_row < rows)
        # slots of the page past the sequence hold whatever a block held before (NaN in the suite):
        # p is 0 there, but 0 * NaN is NaN, so those value rows are zeroed before the p @ v product
        written = (page * block_size + lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)) < seq_len  # [bs, 1]
        if sliding_window is not None:
            allowed &= q_pos - k_pos < sliding_window
        for h in range(num_kv_heads):
            k = kv_ref[:, (2 * h) // packing, (2 * h) % packing, :]  # [bs, Dp]
            v = jnp.where(written, kv_ref[:, (2 * h + 1) // packing, (2 * h + 1) % packing, :], 0)
            q = q_ref[h]  # [G*Tq, Dp], already scaled
            if k.dtype != q.dtype:
                k, v = k.astype(q.dtype), v.astype(q.dtype)
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [R, bs]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(allowed, s, MASK_VALUE)
            m_prev = m_ref[h][:, :1]  # [R, 1]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            p = jnp.where(allowed, jnp.exp(s - m_next), 0.0)  # [R, bs]
            alpha = jnp.exp(m_prev - m_next)  # [R, 1]: rescales what earlier pages summed
            l_next = alpha * l_ref[h][:, :1] + jnp.sum(p, axis=1, keepdims=True)
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)  # [R, Dp]
            acc_ref[h] = alpha * acc_ref[h] + pv
            m_ref[h] = jnp.broadcast_to(m_next, (num_rows, _STAT_LANES))
            l_ref[h] = jnp.broadcast_to(l_next, (num_rows, _STAT_LANES))

    @pl.when(page == num_pages - 1)
    def _finish() -> None:
        for h in range(num_kv_heads):
            total = l_ref[h][:, :1]
            o_ref[h] = (acc_ref[h] / jnp.where(total > 0.0, total, 1.0)).astype(o_ref.dtype)


def _attention_pass(
    q4: jax.Array,  # [T, Hkv, G, Dp], scaled
    pages: jax.Array,  # [NB, bs, 2Hkv/packing, packing, Dp]
    block_tables: jax.Array,  # [B, W]
    seq_lens: jax.Array,  # [B]
    plan: _TilePlan,
    out: jax.Array,  # [T + 1, H, Dp]: row T takes the idle rows' writes
    *,
    q_tile: int,
    sliding_window: int | None,
    soft_cap: float | None,
    interpret: bool,
) -> jax.Array:
    """Run the kernel over ``plan``'s tiles and scatter their rows into ``out``."""
    num_tokens, num_kv_heads, group, dp = q4.shape
    block_size, packing = pages.shape[1], pages.shape[3]
    num_tiles = plan.seq.shape[0]
    width = block_tables.shape[1]
    rows_per_tile = group * q_tile

    t_in_tile = jnp.arange(q_tile, dtype=jnp.int32)
    tokens = jnp.clip(plan.tok0[:, None] + t_in_tile[None, :], 0, num_tokens - 1)  # [N, Tq]
    q_tiles = q4[tokens]  # [N, Tq, Hkv, G, Dp]
    q_tiles = q_tiles.transpose(0, 2, 3, 1, 4).reshape(num_tiles, num_kv_heads, rows_per_tile, dp)

    def page_index(tile, page, bt_ref, sl_ref, seq_ref, pos0_ref, rows_ref):  # type: ignore[no-untyped-def]
        first, last = _page_range(
            tile, seq_ref, pos0_ref, rows_ref, block_size=block_size, sliding_window=sliding_window
        )
        # clamped: a page outside [first, last] repeats its neighbour's index, so no new DMA
        return (bt_ref[seq_ref[tile] * width + jnp.clip(page, first, last)], 0, 0, 0, 0)

    def tile_index(tile, page, *_refs):  # type: ignore[no-untyped-def]
        return (tile, 0, 0, 0)

    kernel = functools.partial(
        _attention_kernel,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        q_tile=q_tile,
        packing=packing,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    tile_block = pl.BlockSpec((None, num_kv_heads, rows_per_tile, dp), tile_index)
    o_tiles = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_tiles, width),
            in_specs=[tile_block, pl.BlockSpec((None, *pages.shape[1:]), page_index)],
            out_specs=tile_block,
            scratch_shapes=[
                pltpu.VMEM((num_kv_heads, rows_per_tile, _STAT_LANES), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows_per_tile, _STAT_LANES), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows_per_tile, dp), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_tiles.shape, q4.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(block_tables.reshape(-1), seq_lens, plan.seq, plan.pos0, plan.rows, q_tiles, pages)

    o_tiles = o_tiles.reshape(num_tiles, num_kv_heads, group, q_tile, dp).transpose(0, 3, 1, 2, 4)
    o_tiles = o_tiles.reshape(num_tiles, q_tile, num_kv_heads * group, dp)  # [N, Tq, H, Dp]
    dest = jnp.where(t_in_tile[None, :] < plan.rows[:, None], plan.tok0[:, None] + t_in_tile[None, :], num_tokens)
    return out.at[dest].set(o_tiles, mode="drop")


def write_kv(kv_cache: jax.Array, key: jax.Array, value: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Store ``key``/``value`` [T, Hkv, D] at ``slot_mapping`` [T] (block * block_size + offset).

    Slots < 0 (padding tokens) write nowhere; so do slots past the cache, which a caller must not
    pass (a traced value cannot raise).
    """
    num_blocks, block_size, rows_per_token, packing, dp = kv_cache.shape
    rows = interleave_kv(key.astype(kv_cache.dtype), value.astype(kv_cache.dtype), packing)
    flat = kv_cache.reshape(num_blocks * block_size, rows_per_token, packing, dp)  # leading merge: free
    slots = jnp.where(slot_mapping >= 0, slot_mapping, num_blocks * block_size).astype(jnp.int32)
    return flat.at[slots].set(rows, mode="drop").reshape(kv_cache.shape)


def _check_shapes(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: jax.Array,
    slot_mapping: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    distribution: jax.Array,
    block_size: int,
    q_tile: int,
) -> None:
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape:
        raise ValueError(
            f"q must be [T, H, D] and k, v one [T, Hkv, D] shape; got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    num_tokens, num_heads, head_size = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_size:
        raise ValueError(f"k/v {k.shape} do not match q {q.shape} in tokens or head size")
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    expected = kv_cache_shape(kv_cache.shape[0], block_size, num_kv_heads, head_size, kv_cache.dtype)
    if kv_cache.shape != expected:
        raise ValueError(
            f"kv_cache has shape {kv_cache.shape}; block_size {block_size}, {num_kv_heads} kv heads of "
            f"size {head_size} in {kv_cache.dtype} need {expected} (see plinth_tpu.layout.kv_cache_shape)"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [T={num_tokens}], got {slot_mapping.shape}")
    if block_tables.ndim != 2 or seq_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"block_tables must be [B, W] and seq_lens [B]; got {block_tables.shape}, {seq_lens.shape}")
    if query_start_loc.shape != (block_tables.shape[0] + 1,):
        raise ValueError(f"query_start_loc must be [B+1={block_tables.shape[0] + 1}], got {query_start_loc.shape}")
    if distribution.shape != (3,):
        raise ValueError(f"distribution must be [3] (decode end, prefill end, sequences), got {distribution.shape}")
    for name, arr in (
        ("slot_mapping", slot_mapping),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
        ("distribution", distribution),
    ):
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {arr.dtype}")
    if q_tile <= 0 or q_tile & (q_tile - 1):
        raise ValueError(f"q_tile must be a power of two, got {q_tile}")


def ragged_paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: jax.Array,
    slot_mapping: jax.Array,
    block_tables: jax.Array,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    distribution: jax.Array,
    *,
    scale: float,
    block_size: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
    q_tile: int = DEFAULT_Q_TILE,
) -> tuple[jax.Array, jax.Array]:
    """Write the step's K/V into the cache, then attend: ``-> (out [T, H, D], new kv_cache)``.

    Semantics of plinth's ``AttentionMetadata``: sequence ``i`` owns query tokens
    ``query_start_loc[i]:query_start_loc[i+1]``, the last of its ``seq_lens[i]`` kv tokens,
    attending causally; ``sliding_window`` keeps keys with ``q_pos - k_pos < sliding_window``;
    ``soft_cap`` maps scores to ``cap * tanh(s / cap)`` before the softmax; any GQA ratio.

    :param q: ``[T, H, D]`` queries (T a padded bucket); the compute dtype.
    :param k: ``[T, Hkv, D]`` the step's new keys, written at ``slot_mapping``.
    :param v: ``[T, Hkv, D]`` the step's new values.
    :param kv_cache: ``plinth_tpu.layout.kv_cache_shape(...)``; donate it under ``jax.jit``.
    :param slot_mapping: ``[T]`` int32, -1 for a padding token (writes nowhere).
    :param block_tables: ``[B, W]`` int32, fixed width; entries past a sequence's pages are ignored.
    :param seq_lens: ``[B]`` int32 kv lengths including this step's tokens; 0 for a padding sequence.
    :param query_start_loc: ``[B+1]`` int32 cumulative query offsets.
    :param distribution: ``[3]`` int32 ``(d, d+p, n)``: sequences ``[0, d)`` decode one token each,
        ``[d, n)`` are prefills or chunks, sequences ``>= n`` are ignored.
    :param scale: softmax scale applied to ``q @ k``.
    :param block_size: tokens per cache page (must match ``kv_cache.shape[1]``).
    :param interpret: run the kernel in Pallas' interpreter (any JAX backend, e.g. CPU).
    :param q_tile: query tokens per prefill tile (a power of two).
    :returns: the output (rows of padding tokens are zeros) and the updated cache.
    :raises ValueError: an input of the wrong shape or dtype, naming it.
    """
    _check_shapes(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, distribution, block_size, q_tile
    )
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = k.shape[1]
    dp = kv_cache.shape[-1]
    kv_cache = write_kv(kv_cache, k, v, slot_mapping)

    q_scaled = (q.astype(jnp.float32) * scale).astype(q.dtype)
    if dp != head_size:
        q_scaled = jnp.pad(q_scaled, ((0, 0), (0, 0), (0, dp - head_size)))
    q4 = q_scaled.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, dp)  # head n = h*G + g
    out = jnp.zeros((num_tokens + 1, num_heads, dp), q.dtype)
    common = dict(sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)
    decode = _decode_plan(query_start_loc, seq_lens, distribution)
    out = _attention_pass(q4, kv_cache, block_tables, seq_lens, decode, out, q_tile=1, **common)  # type: ignore[arg-type]
    prefill = _prefill_plan(query_start_loc, seq_lens, distribution, num_tokens, q_tile)
    out = _attention_pass(q4, kv_cache, block_tables, seq_lens, prefill, out, q_tile=q_tile, **common)  # type: ignore[arg-type]
    return out[:num_tokens, :, :head_size], kv_cache


__all__ = ["DEFAULT_Q_TILE", "MASK_VALUE", "kv_packing", "ragged_paged_attention", "write_kv"]
