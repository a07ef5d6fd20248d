"""Paged attention over varlen batches: prefill, decode, mixed, chunked and shared-prefix calls.

Each case builds a batch full of traps (:mod:`plinth_conformance.paged`), runs the backend's
``forward`` once, and gates the output on the fp64 golden result with thresholds calibrated on the
reference kernel run in the same dtype. The call must leave the cache and the query untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from plinth.platform.backend import AttentionSpec, Backend, KVCacheLayout
from plinth.platform.reference import ReferenceAttention
from plinth_conformance.cases import AttentionCase
from plinth_conformance.checks import check_repeat, declared_attention, kernel_call
from plinth_conformance.coverage import HeadSweepCase
from plinth_conformance.paged import PagedBatch, build_batch, fill_cache, golden_attention, meta_to, one_thread
from plinth_conformance.tolerance import Verdict, bits, compare


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


def run_attention(
    backend: Backend, spec: AttentionSpec, kind: str, regime: str, case_id: str, seed: int, twice: bool
) -> tuple[Verdict, PagedBatch]:
    """Build a ``kind`` batch, run ``forward`` (twice when ``twice``), check the side effects and the
    repeat, and compare with the fp64 golden result. Returns the verdict and the batch."""
    gen = torch.Generator().manual_seed(seed)
    with one_thread():
        batch = build_batch(spec, kind, gen, regime)
    kernels = declared_attention(backend, spec, case_id)
    layout = backend.capabilities().kv_cache_layout
    device = backend.device_services().device
    with kernel_call(case_id, "allocate_kv_cache()"):
        cache = backend.allocate_kv_cache(spec, batch.num_blocks)
    want = layout.shape(batch.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    assert tuple(cache.shape) == want, f"[{case_id}] allocate_kv_cache gave {tuple(cache.shape)}, layout says {want}"
    with one_thread():
        fill_cache(cache, layout, batch)
    guard = batch.query_guard.to(device)
    query = guard[1 : batch.query.shape[0] + 1]  # a view with a storage offset and NaN rows around
    meta = meta_to(batch.meta, device)
    cache_bits, guard_bits = bits(cache).clone(), bits(guard).clone()

    def call() -> torch.Tensor:
        with kernel_call(case_id, "forward()"):
            result = kernels.forward(query, cache, meta, batch.scale)
            backend.device_services().synchronize()
        return result

    out = call()
    assert out.dtype == query.dtype, f"[{case_id}] output dtype {out.dtype}, expected {query.dtype}"
    assert torch.equal(bits(cache), cache_bits), f"[{case_id}] forward() modified the KV cache"
    assert torch.equal(bits(guard), guard_bits), f"[{case_id}] forward() modified its query"
    if twice:
        out = out.clone()  # a kernel may hand back a reused buffer
        check_repeat(backend, case_id, out, call())
    reduction = max(spec.head_size, batch.meta.max_seq_len)  # QK^T sums over D, softmax and PV over S
    with one_thread():
        verdict = compare(out.cpu(), golden_attention(batch), naive_attention(batch), reduction)
    return verdict, batch


def test_paged_attention(
    plinth_backend: Backend, attention_case: AttentionCase, record_tolerance: Callable[..., None]
) -> None:
    """Every declared (and mandatory) case matches the fp64 golden result within calibrated bounds."""
    case = attention_case
    verdict, batch = run_attention(plinth_backend, case.spec, case.kind, case.regime, case.id, case.seed, case.twice)
    record_tolerance(case.id, case.dtype, verdict)
    where = f"; {_where(batch, verdict.worst_index)}" if verdict.worst_index is not None else ""
    assert verdict.ok, verdict.message(case.id) + where


def test_head_size_sweep(
    plinth_backend: Backend, head_sweep_case: HeadSweepCase, record_tolerance: Callable[..., None]
) -> None:
    """Every declared head size (hundreds, for a backend declaring every multiple of 8) on a small
    batch with a prefill, a decode and a chunk: the tails (sizes no multiple of 16 or 32) included."""
    case = head_sweep_case
    failed: list[str] = []
    for head_size in case.head_sizes:
        spec = replace(case.spec, head_size=head_size)
        sub_id = f"{case.id}:h{head_size}"
        verdict, batch = run_attention(plinth_backend, spec, "sweep", "normal", sub_id, case.seed + head_size, False)
        record_tolerance(sub_id, case.dtype, verdict)
        if not verdict.ok:
            where = f"; {_where(batch, verdict.worst_index)}" if verdict.worst_index is not None else ""
            failed.append(verdict.message(sub_id) + where)
    assert not failed, f"[{case.id}] {len(failed)} of {len(case.head_sizes)} head sizes fail: " + " | ".join(failed[:3])
