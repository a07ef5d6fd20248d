"""Perf tier: kernel timings as a share of the roofline measured in the same run.

Slow is reported, never failed. But every timed call is also checked: the perf shapes are the
longest the suite runs, and a fast path that only they reach must be right too. A case fails when
the kernel cannot run or its output (or the cache it wrote) is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from plinth.platform.backend import AttentionMetadata, AttentionSpec, Backend
from plinth.platform.devices import HOST
from plinth.platform.reference import ReferenceGemm
from plinth_conformance.cases import PerfCase
from plinth_conformance.checks import declared_attention, declared_gemm, kernel_call
from plinth_conformance.paged import PagedBatch, canonical_view, golden_attention, one_thread
from plinth_conformance.perf import best_time, roofline
from plinth_conformance.plugin import SuiteState
from plinth_conformance.suite.test_attention import naive_attention
from plinth_conformance.tolerance import bits, compare

#: Decode: 16 sequences of 512 cached tokens, 16 query heads over 4 KV heads of 128.
SEQS, KV_LEN, HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 16, 512, 16, 4, 128, 16


@pytest.fixture(scope="module")
def machine_roofline(plinth_backend: Backend, plinth_state: SuiteState) -> dict[str, float]:
    """Read bandwidth and GEMM peak of this machine, measured once per run (kept in the certificate)."""
    services = plinth_backend.device_services()
    if not plinth_state.roofline:
        plinth_state.roofline = roofline(services.device, services.synchronize)
    return plinth_state.roofline


def _contiguous_meta(q_lens: list[int], seq_lens: list[int], device: torch.device) -> AttentionMetadata:
    """Sequence i owns pages ``i * pages_per_seq ...``; layout does not matter for timing."""
    per_seq = math.ceil(max(seq_lens) / BLOCK)
    tables = torch.arange(len(q_lens) * per_seq, dtype=torch.int32).view(len(q_lens), per_seq)
    return AttentionMetadata.from_lengths(q_lens, seq_lens, tables, block_size=BLOCK, device=device)


def test_perf(
    plinth_backend: Backend,
    perf_case: PerfCase,
    machine_roofline: dict[str, float],
    record_perf: Callable[..., None],
) -> None:
    """Time one kernel and record its share of the roofline."""
    case = perf_case
    services = plinth_backend.device_services()
    dev, sync = services.device, services.synchronize
    bw, peak = machine_roofline["read_gbps"], machine_roofline["gemm_gflops"]
    spec = AttentionSpec(HEADS, KV_HEADS, HEAD_SIZE, BLOCK, "float32", "float32")
    if case.name in ("decode-attention", "prefill-attention", "kv-write"):
        kernels = declared_attention(plinth_backend, spec, case.id)
        q_lens, seq_lens = ([1] * SEQS, [KV_LEN] * SEQS) if case.name != "prefill-attention" else ([KV_LEN], [KV_LEN])
        meta = _contiguous_meta(q_lens, seq_lens, HOST)  # the oracle's copy
        meta_dev = _contiguous_meta(q_lens, seq_lens, dev)
        cache = plinth_backend.allocate_kv_cache(spec, len(q_lens) * math.ceil(KV_LEN / BLOCK))
        cache.normal_()
        tokens = sum(q_lens)
        if case.name == "kv-write":
            key = torch.randn(SEQS * 32, KV_HEADS, HEAD_SIZE, device=dev)
            slots = torch.arange(SEQS * 32, dtype=torch.int64, device=dev)
            with kernel_call(case.id, "write_kv()"):
                seconds = best_time(lambda: kernels.write_kv(key, key, cache, slots), sync)
            _check_kv_write(case.id, cache, spec, plinth_backend, key)
            moved = 2 * key.numel() * 4 * 2  # read K and V, write them
            achieved, unit, bound = moved / seconds / 1e9, "GB/s", "bandwidth"
            shape = f"{SEQS * 32} tokens x {KV_HEADS}x{HEAD_SIZE}"
        else:
            query = torch.randn(tokens, HEADS, HEAD_SIZE, device=dev)
            with kernel_call(case.id, "forward()"):
                seconds = best_time(lambda: kernels.forward(query, cache, meta_dev, HEAD_SIZE**-0.5), sync)
                out = kernels.forward(query, cache, meta_dev, HEAD_SIZE**-0.5)
                sync()
            _check_attention(case.id, out, query, cache, spec, meta, plinth_backend)
            if case.name == "decode-attention":
                moved = 2 * SEQS * KV_LEN * KV_HEADS * HEAD_SIZE * 4  # every cached K and V read once
                achieved, unit, bound = moved / seconds / 1e9, "GB/s", "bandwidth"
                shape = f"{SEQS} seqs x {KV_LEN} kv, {HEADS}/{KV_HEADS} heads x {HEAD_SIZE}"
            else:
                flops = 4 * HEADS * HEAD_SIZE * KV_LEN * (KV_LEN + 1) / 2  # causal QK^T and PV
                achieved, unit, bound = flops / seconds / 1e9, "GFLOP/s", "GEMM peak"
                shape = f"1 seq x {KV_LEN} tokens, {HEADS}/{KV_HEADS} heads x {HEAD_SIZE}"
    else:
        m, k, n = (1, 576, 49152) if case.name == "gemm-m1" else (512, 576, 1536)
        gemm = declared_gemm(plinth_backend, "float32", case.id)
        w = torch.randn(n, k) / math.sqrt(k)
        with kernel_call(case.id, "prepare()"):
            weight = gemm.prepare(w, None)
        x = torch.randn(m, k, device=dev)
        with kernel_call(case.id, "linear()"):
            seconds = best_time(lambda: gemm.linear(x, weight), sync)
            out = gemm.linear(x, weight)
            sync()
        with one_thread():
            x_host = x.cpu()
            naive = ReferenceGemm(torch.float32).linear(x_host, ReferenceGemm(torch.float32).prepare(w, None))
            verdict = compare(out.cpu(), x_host.double() @ w.double().t(), naive, k)
        assert verdict.ok, verdict.message(case.id)
        shape = f"{m}x{k}x{n}"
        if m == 1:  # reading the weight dominates
            achieved, unit, bound = n * k * 4 / seconds / 1e9, "GB/s", "bandwidth"
        else:
            achieved, unit, bound = 2 * m * k * n / seconds / 1e9, "GFLOP/s", "GEMM peak"
    pct = 100.0 * achieved / (bw if bound == "bandwidth" else peak)
    record_perf(name=case.name, shape=shape, ms=seconds * 1e3, achieved=achieved, unit=unit, bound=bound, percent=pct)


def _check_attention(
    case_id: str,
    out: torch.Tensor,
    query: torch.Tensor,
    cache: torch.Tensor,
    spec: AttentionSpec,
    meta: AttentionMetadata,
    backend: Backend,
) -> None:
    """The timed attention's output against the fp64 golden result over the cache's pages."""
    layout = backend.capabilities().kv_cache_layout
    with one_thread():
        view = canonical_view(cache.cpu(), layout, spec)  # [2, NB, B, Hkv, D]
        tables = meta.block_tables.long()
        pages = [tables[i, : math.ceil(s / BLOCK)].tolist() for i, s in enumerate(meta.seq_lens_host)]
        keys = [view[0, p].flatten(0, 1)[:s] for p, s in zip(pages, meta.seq_lens_host, strict=True)]
        values = [view[1, p].flatten(0, 1)[:s] for p, s in zip(pages, meta.seq_lens_host, strict=True)]
        q = query.cpu()
        batch = PagedBatch(spec, q, q, keys, values, pages, meta, int(view.shape[1]), HEAD_SIZE**-0.5)
        verdict = compare(out.cpu(), golden_attention(batch), naive_attention(batch), max(HEAD_SIZE, KV_LEN))
    assert verdict.ok, verdict.message(case_id)


def _check_kv_write(
    case_id: str, cache: torch.Tensor, spec: AttentionSpec, backend: Backend, key: torch.Tensor
) -> None:
    """The timed write left the keys (as K and V) in slots ``0 .. len(key)``, bit for bit."""
    view = canonical_view(cache.cpu(), backend.capabilities().kv_cache_layout, spec)  # [2, NB, B, Hkv, D]
    written = view[:, : key.shape[0] // BLOCK].flatten(1, 2)  # [2, T, Hkv, D]
    for half, name in ((0, "K"), (1, "V")):
        wrong = (bits(written[half]) != bits(key.cpu())).flatten(1).any(dim=1).nonzero().flatten().tolist()
        assert not wrong, f"[{case_id}] the timed write_kv() left {name} of slots {wrong[:5]} wrong"
