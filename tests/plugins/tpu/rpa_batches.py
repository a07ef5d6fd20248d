"""Varlen batches for the ragged paged attention tests: random caches, padded to buckets."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from plinth_tpu.layout import from_plain_kv


@dataclass
class Batch:
    """One step's inputs as jax arrays, plus the plain caches the context was written into."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    kv_cache: jax.Array
    slot_mapping: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array
    distribution: jax.Array
    query_lens: list[int]  # real sequences only
    real_seq_lens: list[int]
    block_size: int

    @property
    def num_real_tokens(self) -> int:
        return sum(self.query_lens)

    def args(self) -> tuple[jax.Array, ...]:
        return (
            self.q,
            self.k,
            self.v,
            self.kv_cache,
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.distribution,
        )


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int = 16,
    dtype: jnp.dtype = jnp.float32,
    kv_dtype: jnp.dtype = jnp.float32,
    tokens_bucket: int | None = None,
    seqs_bucket: int | None = None,
    width: int | None = None,
    num_blocks: int | None = None,
    magnitude: float = 1.0,
    seed: int = 0,
) -> Batch:
    """``seqs`` = ``(query_len, seq_len)`` per real sequence, decodes (query_len 1) first.

    The ``seq_len - query_len`` context tokens of each sequence are already in the cache (random);
    its query tokens' K/V are this step's ``k``/``v``. Blocks are a random permutation, so no
    sequence's pages are contiguous. Tokens, sequences and the block-table width are padded to
    the buckets (padding tokens: slot -1; padding sequences: length 0).
    """
    rng = np.random.default_rng(seed)
    query_lens = [q for q, _ in seqs]
    seq_lens = [s for _, s in seqs]
    if any(q > s or q <= 0 for q, s in seqs):
        raise ValueError(f"every sequence needs 0 < query_len <= seq_len: {seqs}")
    num_decodes = 0
    while num_decodes < len(seqs) and query_lens[num_decodes] == 1:
        num_decodes += 1
    num_fresh = sum(1 for q, s in seqs[num_decodes:] if q == s)
    total = sum(query_lens)
    t_bucket = tokens_bucket or total
    b_bucket = seqs_bucket or len(seqs)
    pages = [math.ceil(s / block_size) for s in seq_lens]
    w = width or max(pages)
    nb = num_blocks or sum(pages) + 3
    perm = rng.permutation(nb)
    tables = np.zeros((b_bucket, w), np.int32)
    used = 0
    for i, n in enumerate(pages):
        tables[i, :n] = perm[used : used + n]
        used += n
    tables[len(seqs) :] = 0

    k_plain = (rng.standard_normal((nb, block_size, num_kv_heads, head_size)) * magnitude).astype(np.float32)
    v_plain = rng.standard_normal((nb, block_size, num_kv_heads, head_size)).astype(np.float32)
    q = np.zeros((t_bucket, num_heads, head_size), np.float32)
    k = np.zeros((t_bucket, num_kv_heads, head_size), np.float32)
    v = np.zeros((t_bucket, num_kv_heads, head_size), np.float32)
    q[:total] = rng.standard_normal((total, num_heads, head_size)) * magnitude
    k[:total] = rng.standard_normal((total, num_kv_heads, head_size)) * magnitude
    v[:total] = rng.standard_normal((total, num_kv_heads, head_size))
    slots = np.full(t_bucket, -1, np.int32)
    qsl = np.zeros(b_bucket + 1, np.int32)
    tok = 0
    for i, (ql, sl) in enumerate(seqs):
        for j in range(ql):
            pos = sl - ql + j
            slots[tok] = tables[i, pos // block_size] * block_size + pos % block_size
            tok += 1
        qsl[i + 1] = tok
    qsl[len(seqs) + 1 :] = tok
    lens = np.zeros(b_bucket, np.int32)
    lens[: len(seqs)] = seq_lens
    cache = from_plain_kv(jnp.asarray(k_plain, kv_dtype), jnp.asarray(v_plain, kv_dtype))
    return Batch(
        q=jnp.asarray(q, dtype),
        k=jnp.asarray(k, dtype),
        v=jnp.asarray(v, dtype),
        kv_cache=cache,
        slot_mapping=jnp.asarray(slots),
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(lens),
        query_start_loc=jnp.asarray(qsl),
        distribution=jnp.asarray([num_decodes, num_decodes + num_fresh, len(seqs)], jnp.int32),
        query_lens=query_lens,
        real_seq_lens=seq_lens,
        block_size=block_size,
    )
