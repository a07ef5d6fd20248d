"""A plain-``jax.numpy`` ragged paged attention: the kernel's oracle, gather-based and dense.

Same signature and semantics as :func:`plinth_tpu.ragged_attention.ragged_paged_attention`, written
the obvious way instead: the KV write on the plain K/V caches by indexing, every token's keys
gathered from its sequence's whole block table, one masked softmax (``jax.nn.softmax``) per row.
It never tiles, never runs an online softmax and ignores ``distribution`` except for ``n``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from plinth_tpu.layout import from_plain_kv, gather_kv


def reference_ragged_paged_attention(
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
) -> tuple[jax.Array, jax.Array]:
    """``-> (out [T, H, D] float32-computed in q's dtype, new kv_cache)``; padding rows are zeros."""
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    key_cache, value_cache = gather_kv(kv_cache, head_size)  # [NB, bs, Hkv, D] each
    num_blocks = key_cache.shape[0]

    # KV write: slot -> (block, offset); padding slots go out of bounds and are dropped
    slot = jnp.where(slot_mapping >= 0, slot_mapping, num_blocks * block_size)
    key_cache = key_cache.at[slot // block_size, slot % block_size].set(k.astype(key_cache.dtype), mode="drop")
    value_cache = value_cache.at[slot // block_size, slot % block_size].set(v.astype(value_cache.dtype), mode="drop")

    num_seqs, width = block_tables.shape
    keys = key_cache[block_tables].reshape(num_seqs, width * block_size, num_kv_heads, head_size)
    values = value_cache[block_tables].reshape(num_seqs, width * block_size, num_kv_heads, head_size)

    token = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(query_start_loc, token, side="right") - 1, 0, num_seqs - 1)  # [T]
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    real = (token < query_start_loc[jnp.minimum(distribution[2], num_seqs)]) & (seq < distribution[2])
    real &= seq_lens[seq] > 0
    q_pos = seq_lens[seq] - q_len + (token - query_start_loc[seq])  # [T]

    k_tok = jnp.repeat(keys[seq], group, axis=2).astype(jnp.float32)  # [T, S, H, D]
    v_tok = jnp.repeat(values[seq], group, axis=2).astype(jnp.float32)
    scores = jnp.einsum("thd,tshd->ths", q.astype(jnp.float32), k_tok) * scale  # [T, H, S]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    k_pos = jnp.arange(width * block_size)[None, :]
    allowed = (k_pos <= q_pos[:, None]) & (k_pos < seq_lens[seq][:, None]) & real[:, None]  # [T, S]
    if sliding_window is not None:
        allowed &= q_pos[:, None] - k_pos < sliding_window
    scores = jnp.where(allowed[:, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(allowed[:, None, :], probs, 0.0)  # fully masked (padding) rows: NaN -> 0
    out = jnp.einsum("ths,tshd->thd", probs, v_tok).astype(q.dtype)
    return out, from_plain_kv(key_cache, value_cache)
