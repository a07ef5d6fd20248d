"""Paged attention over varlen batches: prefill, decode, mixed, chunked and shared-prefix calls.

Each case builds a batch full of traps (:mod:`plinth_conformance.paged`), runs the backend's
``forward`` once, and gates the output on the fp64 golden result with thresholds calibrated on the
reference kernel run in the same dtype. The call must leave the cache and the query untouched.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plinth.platform.backend import Backend, KVCacheLayout
from plinth.platform.reference import ReferenceAttention
from plinth_conformance.cases import AttentionCase
from plinth_conformance.checks import declared_attention, kernel_call
from plinth_conformance.paged import PagedBatch, build_batch, fill_cache, golden_attention, meta_to
from plinth_conformance.tolerance import bits, compare


def naive_attention(batch: PagedBatch) -> torch.Tensor:
    """The reference kernel in the case's own dtype, on a reference-layout copy of the cache."""
    spec = batch.spec
    layout = KVCacheLayout()
    kv_dtype = batch.keys[0].dtype
    cache = torch.empty(
        layout.shape(batch.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size), dtype=kv_dtype
    )
    fill_cache(cache, layout, batch)
    return ReferenceAttention(spec, layout).forward(batch.query, cache, batch.meta, batch.scale)


def _where(batch: PagedBatch, flat_index: int) -> str:
    """Name the sequence, position and head of a flat output index."""
    _, heads, head_size = batch.query.shape
    token, head = flat_index // (heads * head_size), (flat_index // head_size) % heads
    seq, pos = batch.token_owner(token)
    seq_len = batch.meta.seq_lens_host[seq]
    q_len = batch.meta.query_lens_host[seq]
    return (
        f"worst at token {token}: sequence {seq} (kv length {seq_len}, {q_len} new, block size "
        f"{batch.spec.block_size}), position {pos}, head {head}"
    )


def test_paged_attention(
    plinth_backend: Backend, attention_case: AttentionCase, record_tolerance: Callable[..., None]
) -> None:
    """Every declared (and mandatory) case matches the fp64 golden result within calibrated bounds."""
    case = attention_case
    spec = case.spec
    gen = torch.Generator().manual_seed(case.seed)
    batch = build_batch(spec, case.kind, gen)
    kernels = declared_attention(plinth_backend, spec, case.id)
    layout = plinth_backend.capabilities().kv_cache_layout
    device = plinth_backend.device_services().device
    with kernel_call(case.id, "allocate_kv_cache()"):
        cache = plinth_backend.allocate_kv_cache(spec, batch.num_blocks)
    want = layout.shape(batch.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    assert tuple(cache.shape) == want, f"[{case.id}] allocate_kv_cache gave {tuple(cache.shape)}, layout says {want}"
    fill_cache(cache, layout, batch)
    guard = batch.query_guard.to(device)
    query = guard[1 : batch.query.shape[0] + 1]  # a view with a storage offset and NaN rows around
    meta = meta_to(batch.meta, device)
    cache_bits, guard_bits = bits(cache).clone(), bits(guard).clone()

    with kernel_call(case.id, "forward()"):
        out = kernels.forward(query, cache, meta, batch.scale)
        plinth_backend.device_services().synchronize()

    assert out.dtype == query.dtype, f"[{case.id}] output dtype {out.dtype}, expected {query.dtype}"
    assert torch.equal(bits(cache), cache_bits), f"[{case.id}] forward() modified the KV cache"
    assert torch.equal(bits(guard), guard_bits), f"[{case.id}] forward() modified its query"
    reduction = max(spec.head_size, batch.meta.max_seq_len)  # QK^T sums over D, softmax and PV over S
    verdict = compare(out.cpu(), golden_attention(batch), naive_attention(batch), reduction)
    record_tolerance(case.id, case.dtype, verdict)
    where = f"; {_where(batch, verdict.worst_index)}" if verdict.worst_index is not None else ""
    assert verdict.ok, verdict.message(case.id) + where
