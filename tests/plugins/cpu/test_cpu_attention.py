"""The CPU backend's attention kernels against the reference backend (the oracle).

Every batch is built to be hostile: shuffled, non-contiguous block ids; NaN in every cache page
and page tail a sequence does not own; padding block-table entries that are out of range or point
at NaN pages; NaN query rows for padding tokens. Outputs must stay finite and match the reference.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plinth.platform.backend import AttentionMetadata, AttentionSpec, KVCacheLayout
from plinth.platform.reference import ReferenceAttention
from plinth_cpu.attention import CPU_KV_LAYOUT, CpuAttention, _query_tiles

SCALE = 0.125
PAD_TOKENS = 3  # query rows past query_start_loc[-1]: padding the runner may add


@dataclass
class Batch:
    """A varlen batch over a paged cache, ready for both kernels."""

    spec: AttentionSpec
    query: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, NB, Hkv, bs, D]: CPU_KV_LAYOUT
    meta: AttentionMetadata

    @property
    def reference_cache(self) -> torch.Tensor:
        """The same cache in the reference's layout [2, NB, bs, Hkv, D] (a view)."""
        return self.kv_cache.transpose(2, 3)


def make_batch(
    cases: list[tuple[int, int]],
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    seed: int = 0,
    spare_blocks: int = 5,
) -> Batch:
    """``cases`` is ``[(q_len, seq_len), ...]``; each sequence's K/V is already in the cache."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    spec = AttentionSpec(
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=str(dtype).removeprefix("torch."),
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    need = [math.ceil(s / block_size) for _, s in cases]
    num_blocks = sum(need) + spare_blocks
    free = list(range(num_blocks))
    rng.shuffle(free)  # non-contiguous, out-of-order block ids
    nan_pages = free[sum(need) :]  # never owned by a sequence: stay NaN
    cache = torch.full((2, num_blocks, num_kv_heads, block_size, head_size), float("nan"), dtype=dtype)
    ref_view = cache.transpose(2, 3)  # [2, NB, bs, Hkv, D]
    width = max(need) + 2
    tables = torch.empty(len(cases), width, dtype=torch.int32)
    for i, (n, (_, seq_len)) in enumerate(zip(need, cases, strict=True)):
        blocks = [free.pop(0) for _ in range(n)]
        garbage = [rng.choice([-1, 10**6, *nan_pages]) for _ in range(width - n)]
        tables[i] = torch.tensor(blocks + garbage)
        pos = torch.arange(seq_len)
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        kv = torch.randn(2, seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        ref_view[:, slots // block_size, slots % block_size] = kv  # tails past seq_len stay NaN
    q_lens = [q for q, _ in cases]
    seq_lens = [s for _, s in cases]
    total = sum(q_lens)
    query = torch.randn(total + PAD_TOKENS, num_heads, head_size, generator=gen).to(dtype)
    query[total:] = float("nan")  # padding tokens: must never be read
    meta = AttentionMetadata.from_lengths(
        q_lens, seq_lens, tables, slot_mapping=torch.full((total + PAD_TOKENS,), -1, dtype=torch.int64)
    )  # the slots are unused by forward
    return Batch(spec, query, cache, meta)


def run_both(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(cpu output, reference output) for ``batch``."""
    ours = CpuAttention(batch.spec).forward(batch.query, batch.kv_cache, batch.meta, SCALE)
    ref = ReferenceAttention(batch.spec, KVCacheLayout()).forward(batch.query, batch.reference_cache, batch.meta, SCALE)
    return ours, ref


def assert_matches_reference(batch: Batch, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Finite everywhere, equal to the reference, zero for padding tokens."""
    ours, ref = run_both(batch)
    assert ours.dtype == batch.query.dtype and ours.shape == batch.query.shape
    assert torch.isfinite(ours).all(), "NaN/inf leaked from stale pages or padding"
    torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol)
    assert (ours[-PAD_TOKENS:] == 0).all()


# Block size 16: lengths 1, B-1, B, B+1 and several blocks; decodes and prefill chunks mixed, one
# chunk with earlier context, one fresh prefill, one sequence with no tokens this step.
MIXED = [(1, 1), (1, 15), (5, 16), (1, 17), (16, 40), (0, 9), (3, 50), (1, 33), (21, 21)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 4), (8, 2), (16, 2), (8, 1)])
@pytest.mark.parametrize("head_size", [64, 80, 128])
def test_mixed_batch_matches_reference(num_heads: int, num_kv_heads: int, head_size: int) -> None:
    """GQA ratios 1, 2, 4, 8 and MQA, three head sizes, on one ragged mixed batch."""
    assert_matches_reference(make_batch(MIXED, num_heads, num_kv_heads, head_size))


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
def test_block_sizes_and_boundaries(block_size: int) -> None:
    """kv lengths at 1, B-1, B, B+1 and a few blocks, for every declared block size."""
    b = block_size
    cases = [(1, 1), (1, b - 1), (2, b), (1, b + 1), (4, 3 * b + 2), (b + 1, 2 * b + 1)]
    assert_matches_reference(make_batch(cases, block_size=block_size, seed=b))


@pytest.mark.parametrize("window", [1, 5, 16, 37, 1000])
def test_sliding_window(window: int) -> None:
    """Windows narrower than a block, equal to one, across blocks and wider than every sequence."""
    assert_matches_reference(make_batch(MIXED, sliding_window=window, seed=window))


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("num_kv_heads", [8, 2, 1])
def test_logits_soft_cap(window: int | None, num_kv_heads: int) -> None:
    """cap * tanh(s / cap) before the mask, alone and with a sliding window."""
    batch = make_batch(MIXED, 8, num_kv_heads, logits_soft_cap=2.5, sliding_window=window)
    assert_matches_reference(batch)


def test_pure_decode_batch() -> None:
    """The decode fast path alone: every q_len is 1."""
    cases = [(1, s) for s in (1, 2, 15, 16, 17, 64, 100, 129)]
    assert_matches_reference(make_batch(cases, 16, 4, 128, seed=3))


def test_long_prefill_chunks_cross_query_tiles() -> None:
    """Query tiles (and their key ranges) with ragged chunks that end in different tiles."""
    cases = [(300, 300), (150, 500), (65, 65), (1, 200), (2, 700)]
    assert_matches_reference(make_batch(cases, 8, 2, 64, seed=4))
    assert_matches_reference(make_batch(cases, 8, 2, 64, sliding_window=50, seed=5))
    assert_matches_reference(make_batch(cases, 8, 2, 64, logits_soft_cap=3.0, seed=6))


def test_query_tiles_cover_every_visible_key() -> None:
    """Each tile's key range holds every key a real row of the tile may see, and is causal-tight."""
    q_lens, seq_lens, window = [300, 150, 65], [300, 500, 65], 40
    tiles = _query_tiles(q_lens, seq_lens, window)
    assert tiles[0][0] == 0 and tiles[-1][1] == max(q_lens)
    for j0, j1, lo, hi in tiles:
        for q, s in zip(q_lens, seq_lens, strict=True):
            for j in range(j0, min(j1, q)):
                pos = s - q + j
                assert lo <= max(0, pos - window + 1) and pos < hi
    assert tiles[0][3] < max(seq_lens)  # the first tile does not read the whole context


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_precision_upcasts(dtype: torch.dtype, tol: float) -> None:
    """bf16/fp16 query and cache: computed in fp32 like the reference, rounded once at the end."""
    for cap in (None, 4.0):
        batch = make_batch(MIXED, 8, 2, 64, dtype=dtype, logits_soft_cap=cap, seed=7)
        assert_matches_reference(batch, rtol=tol, atol=tol)


def test_float64_is_exact() -> None:
    """fp64 stays fp64 all the way."""
    assert_matches_reference(make_batch(MIXED, 8, 4, 64, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_fp32_query_over_bf16_cache() -> None:
    """A kv-cache dtype narrower than the compute dtype is upcast on read."""
    batch = make_batch(MIXED, 8, 2, 64, dtype=torch.bfloat16, seed=8)
    batch.query = batch.query.float()
    assert_matches_reference(batch)


def test_one_kernel_object_across_calls() -> None:
    """Scratch buffers reused across calls of any size never leak into results or outputs."""
    kernels = CpuAttention(AttentionSpec(8, 2, 64, 16))
    batches = [make_batch(cases, seed=i) for i, cases in enumerate([MIXED, [(1, 5)], [(40, 300), (1, 64)], MIXED])]
    outs = []
    for batch in batches:
        out = kernels.forward(batch.query, batch.kv_cache, batch.meta, SCALE)
        ref = ReferenceAttention(batch.spec, KVCacheLayout()).forward(
            batch.query, batch.reference_cache, batch.meta, SCALE
        )
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        outs.append((out, out.clone()))
    for out, snapshot in outs:  # later calls did not write into earlier outputs
        torch.testing.assert_close(out, snapshot, rtol=0, atol=0)


@settings(max_examples=25, deadline=None)
@given(
    cases=st.lists(
        st.tuples(st.integers(0, 20), st.integers(0, 60)).map(lambda t: (t[0], max(t[0], t[1], 1))),
        min_size=1,
        max_size=6,
    ).filter(lambda cs: any(q > 0 for q, _ in cs)),
    kv_heads_group=st.sampled_from([(4, 1), (2, 2), (1, 4), (1, 8)]),
    block_size=st.sampled_from([8, 16, 32]),
    window=st.one_of(st.none(), st.integers(1, 40)),
    cap=st.one_of(st.none(), st.floats(1.0, 30.0)),
    seed=st.integers(0, 2**16),
)
def test_random_batches_match_reference(
    cases: list[tuple[int, int]],
    kv_heads_group: tuple[int, int],
    block_size: int,
    window: int | None,
    cap: float | None,
    seed: int,
) -> None:
    """Any ragged mix of lengths, GQA ratios, block sizes, windows and caps."""
    num_kv_heads, group = kv_heads_group
    batch = make_batch(
        cases,
        num_kv_heads * group,
        num_kv_heads,
        32,
        block_size,
        sliding_window=window,
        logits_soft_cap=cap,
        seed=seed,
    )
    assert_matches_reference(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(dtype: torch.dtype) -> None:
    """All T tokens in one scatter, padding slots (-1) skipped, cast to the cache dtype."""
    num_blocks, block_size, hkv, d = 6, 16, 2, 64
    spec = AttentionSpec(4, hkv, d, block_size, kv_cache_dtype=str(dtype).removeprefix("torch."))
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:40]
    slots[[0, 7, 39]] = -1  # padding tokens
    key = torch.randn(40, hkv, d, generator=gen)
    value = torch.randn(40, hkv, d, generator=gen)
    ours = torch.full(CPU_KV_LAYOUT.shape(num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    ref = torch.full(KVCacheLayout().shape(num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    CpuAttention(spec).write_kv(key, value, ours, slots)
    ReferenceAttention(spec, KVCacheLayout()).write_kv(key, value, ref, slots)
    torch.testing.assert_close(ours.transpose(2, 3), ref, equal_nan=True, rtol=0, atol=0)
    # A strided (non-contiguous) cache and a strided value tensor must work too.
    strided = torch.full_like(ours, float("nan")).transpose(3, 4).contiguous().transpose(3, 4)
    CpuAttention(spec).write_kv(key, value.transpose(0, 1).contiguous().transpose(0, 1), strided, slots)
    torch.testing.assert_close(strided, ours, equal_nan=True, rtol=0, atol=0)


def test_write_then_forward_round_trip() -> None:
    """write_kv followed by forward equals the reference doing both, on a fresh prefill."""
    spec = AttentionSpec(8, 2, 64, 16)
    gen = torch.Generator().manual_seed(1)
    seq_len = 37
    table = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32)  # entry 3 is padding: page 0 is NaN
    pos = torch.arange(seq_len)
    slots = table[0].long()[pos // 16] * 16 + pos % 16
    key, value = torch.randn(2, seq_len, 2, 64, generator=gen)
    query = torch.randn(seq_len, 8, 64, generator=gen)
    meta = AttentionMetadata.from_lengths([seq_len], [seq_len], table, block_size=16)
    assert torch.equal(meta.slot_mapping, slots)
    outs = []
    for kernels, layout in (
        (CpuAttention(spec), CPU_KV_LAYOUT),
        (ReferenceAttention(spec, KVCacheLayout()), KVCacheLayout()),
    ):
        cache = torch.full(layout.shape(8, 16, 2, 64), float("nan"))
        kernels.write_kv(key, value, cache, slots)
        outs.append(kernels.forward(query, cache, meta, SCALE))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_copy_blocks() -> None:
    """The base-class copy-on-write of whole blocks follows this layout's num_blocks axis."""
    cache = torch.randn(CPU_KV_LAYOUT.shape(4, 8, 2, 32))
    before = cache.clone()
    CpuAttention(AttentionSpec(2, 2, 32, 8)).copy_blocks([cache], [(1, 3), (0, 2)])
    torch.testing.assert_close(cache[:, 3], before[:, 1])
    torch.testing.assert_close(cache[:, 2], before[:, 0])
    torch.testing.assert_close(cache[:, :2], before[:, :2])


def test_rejects_other_layouts() -> None:
    """The kernels only read their own layout; another one is refused up front."""
    with pytest.raises(ValueError, match="layout"):
        CpuAttention(AttentionSpec(2, 2, 32, 8), KVCacheLayout())


def _best_times(batch: Batch, reps: int = 5) -> tuple[float, float]:
    """Best-of-``reps`` times of (cpu, reference) on ``batch``, measured side by side.

    One torch thread and the thread's CPU clock: on a shared 2-core host, another process
    stalls OpenMP barriers and preemption inflates wall time, by 2-100x, at random; a single
    thread's CPU time measures the kernels and little else. Interleaved runs see the same
    cache and memory-bandwidth weather.
    """
    ours = CpuAttention(batch.spec)
    ref = ReferenceAttention(batch.spec, KVCacheLayout())
    runs = (
        lambda: ours.forward(batch.query, batch.kv_cache, batch.meta, SCALE),
        lambda: ref.forward(batch.query, batch.reference_cache, batch.meta, SCALE),
    )
    best = [math.inf, math.inf]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for run in runs:  # untimed first calls: a fresh process pays its page faults in them
            run()
        for _ in range(reps):
            for i, run in enumerate(runs):
                t0 = time.thread_time()
                run()
                best[i] = min(best[i], time.thread_time() - t0)
    finally:
        torch.set_num_threads(threads)
    return best[0], best[1]


# (num_heads, num_kv_heads, head_size): SmolLM2-135M (the default model) and Llama-3-8B.
SPEED_SHAPES = {"smollm2": (9, 3, 64), "llama3_8b": (32, 8, 128)}


@pytest.mark.parametrize("shape,at_least", [("smollm2", 1.5), ("llama3_8b", 2.0)])
def test_mixed_batch_faster_than_reference(shape: str, at_least: float) -> None:
    """8 decodes over 512-token contexts plus a fresh 256-token prefill, in one call.

    The prefill half is FLOP-bound: the reference's dense bmm already runs near SDPA's
    efficiency, so skipping the causal upper triangle buys ~1.7-1.9x there, while the decodes
    gain 3.5-7x. Measured on the 2-core AVX2 dev VM: 2.1-2.6x for SmolLM2's shape (small
    heads: fixed per-op costs weigh more), 2.7-4.3x for Llama-3-8B's; the bounds leave room
    for a noisy neighbour.
    """
    batch = make_batch([(1, 512)] * 8 + [(256, 256)], *SPEED_SHAPES[shape], 16, seed=9)
    ours, ref = _best_times(batch)
    print(f"{shape} mixed: cpu {ours * 1e3:.2f} ms, reference {ref * 1e3:.2f} ms: {ref / ours:.1f}x")
    assert ref / ours >= at_least


def test_decode_batch_much_faster_than_reference() -> None:
    """8 decodes over 512-token contexts, Llama-3-8B's attention shape: >= 2.5x. Measured 4-7x on the
    AVX2 dev VM; on an AMD EPYC Zen 5 5-6x alone, but 2.9-4.1x inside a run of tests/plugins/cpu, where
    the reference's time (18-40 ms, one thread's CPU clock) varies far more than this path's (5-7 ms)."""
    batch = make_batch([(1, 512)] * 8, *SPEED_SHAPES["llama3_8b"], 16, seed=10)
    ours, ref = _best_times(batch)
    print(f"decodes: cpu {ours * 1e3:.2f} ms, reference {ref * 1e3:.2f} ms: {ref / ours:.1f}x")
    assert ref / ours >= 2.5
