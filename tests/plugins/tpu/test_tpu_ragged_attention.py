"""The Pallas ragged paged attention (interpret mode, JAX CPU) against two oracles.

Oracles: the plain-jnp gather reference (same signature, whole cache out) and plinth's own
``ReferenceAttention`` on torch tensors (the conformance oracle), on the real rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from plinth_tpu.attention_reference import reference_ragged_paged_attention
from plinth_tpu.layout import gather_kv, kv_cache_shape
from plinth_tpu.ragged_attention import ragged_paged_attention
from rpa_batches import Batch, make_batch

from plinth.platform.backend import AttentionMetadata
from plinth.platform.reference import ReferenceAttention
from plinth.platform.values import AttentionSpec, KVCacheLayout


def _plinth_reference(
    batch: Batch, new_cache: jax.Array, *, scale: float, window: int | None, cap: float | None
) -> np.ndarray:
    """plinth's torch reference over the real sequences, reading the K/V the reference wrote."""
    head_size = batch.q.shape[2]
    k_plain, v_plain = gather_kv(new_cache, head_size)
    kv = torch.stack([torch.tensor(np.asarray(k_plain, np.float32)), torch.tensor(np.asarray(v_plain, np.float32))])
    n = len(batch.query_lens)
    meta = AttentionMetadata.from_lengths(
        batch.query_lens,
        batch.real_seq_lens,
        torch.from_numpy(np.asarray(batch.block_tables)[:n]),
        slot_mapping=torch.from_numpy(np.asarray(batch.slot_mapping)[: batch.num_real_tokens].astype(np.int64)),
    )
    spec = AttentionSpec(
        num_heads=batch.q.shape[1],
        num_kv_heads=batch.k.shape[1],
        head_size=head_size,
        block_size=batch.block_size,
        sliding_window=window,
        logits_soft_cap=cap,
    )
    q = torch.from_numpy(np.asarray(batch.q, np.float32)[: batch.num_real_tokens])
    return ReferenceAttention(spec, KVCacheLayout()).forward(q, kv, meta, scale).numpy()


def _check(
    batch: Batch,
    *,
    window: int | None = None,
    cap: float | None = None,
    atol: float = 2e-5,
    q_tile: int = 8,
) -> np.ndarray:
    scale = batch.q.shape[2] ** -0.5
    kw = dict(scale=scale, block_size=batch.block_size, sliding_window=window, soft_cap=cap)
    out, cache = ragged_paged_attention(*batch.args(), interpret=True, q_tile=q_tile, **kw)  # type: ignore[arg-type]
    ref_out, ref_cache = reference_ragged_paged_attention(*batch.args(), **kw)  # type: ignore[arg-type]
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert cache.shape == batch.kv_cache.shape and cache.dtype == batch.kv_cache.dtype
    np.testing.assert_array_equal(np.asarray(cache, np.float32), np.asarray(ref_cache, np.float32))
    out_np = np.asarray(out, np.float32)
    real = batch.num_real_tokens
    np.testing.assert_allclose(out_np[:real], np.asarray(ref_out, np.float32)[:real], atol=atol, rtol=atol)
    plinth_out = _plinth_reference(batch, ref_cache, scale=scale, window=window, cap=cap)
    np.testing.assert_allclose(out_np[:real], plinth_out, atol=atol, rtol=atol)
    assert np.isfinite(out_np).all()
    np.testing.assert_array_equal(out_np[real:], 0.0)  # padding tokens: zeros
    return out_np


def test_decode_only_with_padding_sequences() -> None:
    b = make_batch(
        [(1, 33), (1, 1), (1, 16), (1, 70)],
        num_heads=4,
        num_kv_heads=4,
        head_size=128,
        tokens_bucket=8,
        seqs_bucket=8,
        width=8,
    )
    _check(b)


def test_fresh_prefills() -> None:
    b = make_batch([(19, 19), (5, 5), (32, 32)], num_heads=6, num_kv_heads=2, head_size=64, tokens_bucket=64)
    _check(b)


def test_mixed_decodes_prefills_and_chunks() -> None:
    seqs = [(1, 40), (1, 9), (12, 12), (9, 50), (3, 17)]  # decodes, a fresh prefill, two chunks after context
    b = make_batch(seqs, num_heads=8, num_kv_heads=1, head_size=128, tokens_bucket=32, seqs_bucket=8, width=6)
    _check(b)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (16, 2)])
def test_gqa_ratios(num_heads: int, num_kv_heads: int) -> None:
    b = make_batch(
        [(1, 21), (10, 30)],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=64,
        tokens_bucket=16,
        seqs_bucket=4,
        seed=num_heads,
    )
    _check(b)


def test_head_size_80_pads_to_128() -> None:
    assert kv_cache_shape(4, 16, 2, 80, jnp.float32)[-1] == 128
    b = make_batch([(1, 18), (7, 25)], num_heads=4, num_kv_heads=2, head_size=80, tokens_bucket=8)
    _check(b)


def test_sliding_window_not_a_multiple_of_the_block() -> None:
    seqs = [(1, 60), (20, 20), (6, 45)]
    b = make_batch(seqs, num_heads=4, num_kv_heads=2, head_size=64, block_size=8, tokens_bucket=32, width=8)
    out = _check(b, window=11)
    full = _check(b, window=None)
    assert np.abs(out - full).max() > 1e-2  # the window changed something


def test_soft_cap_with_large_logits() -> None:
    b = make_batch([(1, 30), (9, 20)], num_heads=4, num_kv_heads=2, head_size=64, magnitude=6.0, tokens_bucket=16)
    capped = _check(b, cap=30.0, atol=1e-4)
    uncapped = ragged_paged_attention(*b.args(), scale=64**-0.5, block_size=16, interpret=True)[0]
    assert np.abs(capped - np.asarray(uncapped)).max() > 1e-2  # the cap acted


def test_large_scores_need_the_running_maximum() -> None:
    # scores in the thousands: exp() overflows float32 without subtracting a running maximum
    b = make_batch(
        [(1, 50), (12, 40)], num_heads=2, num_kv_heads=1, head_size=64, magnitude=30.0, tokens_bucket=16, seed=3
    )
    _check(b, atol=1e-4)


def test_tile_smaller_than_prefill_and_empty_step() -> None:
    b = make_batch([(13, 13), (1, 5)][::-1], num_heads=2, num_kv_heads=1, head_size=64, tokens_bucket=16, seqs_bucket=3)
    _check(b, q_tile=4)
    # a step of padding only: n = 0 writes nothing and returns zeros
    pad = make_batch([(1, 5)], num_heads=2, num_kv_heads=1, head_size=64, tokens_bucket=4, seqs_bucket=2)
    args = list(pad.args())
    args[4] = jnp.full_like(pad.slot_mapping, -1)
    args[8] = jnp.zeros(3, jnp.int32)
    out, cache = ragged_paged_attention(*args, scale=0.125, block_size=16, interpret=True)  # type: ignore[arg-type]
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(pad.kv_cache))


def test_bfloat16_cache_and_queries() -> None:
    seqs = [(1, 37), (1, 3), (10, 10), (6, 28)]
    b = make_batch(
        seqs,
        num_heads=6,
        num_kv_heads=2,
        head_size=128,
        dtype=jnp.bfloat16,
        kv_dtype=jnp.bfloat16,
        tokens_bucket=32,
        seqs_bucket=6,
    )
    assert b.kv_cache.shape[2:4] == (2, 2)  # 2 kv heads -> 4 combined heads, packed 2 per word
    _check(b, atol=3e-2)


def test_float32_queries_over_bfloat16_cache() -> None:
    b = make_batch(
        [(1, 20), (8, 24)], num_heads=4, num_kv_heads=2, head_size=64, kv_dtype=jnp.bfloat16, tokens_bucket=16
    )
    _check(b, atol=1e-4)  # K/V are read exactly (bf16 -> f32), so only float32 rounding remains


def test_bad_inputs_name_the_culprit() -> None:
    b = make_batch([(1, 5)], num_heads=2, num_kv_heads=1, head_size=64)
    args = list(b.args())
    with pytest.raises(ValueError, match="kv_cache has shape"):
        ragged_paged_attention(*args, scale=1.0, block_size=8, interpret=True)  # type: ignore[arg-type]
    args[5] = b.block_tables.astype(jnp.int64) if jax.config.jax_enable_x64 else b.block_tables.astype(jnp.int16)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        ragged_paged_attention(*args, scale=1.0, block_size=16, interpret=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a multiple"):
        ragged_paged_attention(
            b.q[:, :1],
            b.k.repeat(2, axis=1),
            b.v.repeat(2, axis=1),
            *args[3:],
            scale=1.0,
            block_size=16,
            interpret=True,
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="q_tile must be a power of two"):
        ragged_paged_attention(*b.args(), scale=1.0, block_size=16, interpret=True, q_tile=6)  # type: ignore[arg-type]
