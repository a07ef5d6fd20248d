"""The metal backend's attention (emulation: the same torch code on the CPU) against the reference.

Batches are hostile: shuffled block ids, NaN in every page and page tail a sequence does not own,
padding block-table entries out of range. Each MPS defect the kernels design around has a test
that shows its workaround is taken (and that the answer is still the reference's).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
from plinth_metal import attention
from plinth_metal.attention import MetalAttention, aligned_kv_len, bounded_attend, sdpa_attend
from plinth_metal.backend import METAL_KV_LAYOUT

from plinth.platform.backend import AttentionMetadata, AttentionSpec
from plinth.platform.reference import ReferenceAttention, reference_paged_attention

SCALE = 0.125


@dataclass
class Batch:
    spec: AttentionSpec
    query: torch.Tensor  # [T, H, D]
    kv_cache: torch.Tensor  # [2, NB, bs, Hkv, D]
    meta: AttentionMetadata


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
) -> Batch:
    """``cases``: ``[(q_len, seq_len), ...]``, each sequence's K/V already in the cache."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    name = str(dtype).removeprefix("torch.")
    spec = AttentionSpec(
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        dtype=name,
        kv_cache_dtype=name,
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    need = [math.ceil(s / block_size) for _, s in cases]
    num_blocks = sum(need) + 4
    free = list(range(num_blocks))
    rng.shuffle(free)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    width = max(need) + 2
    tables = torch.empty(len(cases), width, dtype=torch.int32)
    for i, (n, (_, seq_len)) in enumerate(zip(need, cases, strict=True)):
        blocks = [free.pop(0) for _ in range(n)]
        tables[i] = torch.tensor(blocks + [rng.choice([-1, 10**6, free[-1]]) for _ in range(width - n)])
        kv = torch.randn(2, seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        for t in range(seq_len):  # only the owned slots are written; tails stay NaN
            cache[:, blocks[t // block_size], t % block_size] = kv[:, t]
    qlens = [q for q, _ in cases]
    query = torch.randn(sum(qlens), num_heads, head_size, generator=gen).to(dtype)
    meta = AttentionMetadata.from_lengths(qlens, [s for _, s in cases], tables, block_size=block_size)
    return Batch(spec, query, cache, meta)


def check(batch: Batch, atol: float = 2e-5) -> torch.Tensor:
    """The metal output, asserted finite and within ``atol`` of the fp32 reference."""
    kernels = MetalAttention(batch.spec, METAL_KV_LAYOUT)
    out = kernels.forward(batch.query, batch.kv_cache, batch.meta, SCALE)
    want = reference_paged_attention(
        batch.query.float(),
        batch.kv_cache[0].float(),
        batch.kv_cache[1].float(),
        batch.meta,
        SCALE,
        sliding_window=batch.spec.sliding_window,
        logits_soft_cap=batch.spec.logits_soft_cap,
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=0)
    return out


# -- against the reference -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "cases",
    [
        pytest.param([(1, 1), (1, 17), (1, 40), (1, 100)], id="decode"),
        pytest.param([(23, 23), (64, 64), (5, 5)], id="prefill"),
        pytest.param([(1, 31), (20, 20), (7, 50), (1, 3), (16, 80)], id="mixed"),
        pytest.param([(7, 50), (1, 9), (30, 30), (1, 64)], id="mixed-unordered"),
    ],
)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_attention_matches_the_reference(cases: list[tuple[int, int]], block_size: int) -> None:
    check(make_batch(cases, block_size=block_size))


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 1), (12, 4), (6, 2)])
def test_gqa_ratios(heads: int, kv_heads: int) -> None:
    check(make_batch([(1, 37), (19, 19), (4, 44)], num_heads=heads, num_kv_heads=kv_heads))


@pytest.mark.parametrize("window", [1, 8, 33])
def test_sliding_window(window: int) -> None:
    check(make_batch([(1, 70), (40, 40), (9, 61), (1, 5)], sliding_window=window))


@pytest.mark.parametrize("window", [None, 16])
def test_logits_soft_cap_takes_the_matmul_path(window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(attention, "sdpa_attend", lambda *a: calls.append(1))  # must not be used
    batch = make_batch([(1, 70), (25, 25), (6, 38)], sliding_window=window, logits_soft_cap=2.0)
    with torch.no_grad():
        batch.query.mul_(4.0)  # scores well past the cap
    check(batch)
    assert not calls


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_half_dtypes(dtype: torch.dtype, atol: float) -> None:
    check(make_batch([(1, 33), (12, 12), (3, 47)], dtype=dtype), atol=atol)


def test_write_kv_skips_negative_slots_and_matches_the_reference() -> None:
    spec = AttentionSpec(4, 2, 64, 16)
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, 9, 2, 64, generator=gen).unbind(0)
    slots = torch.tensor([5, -1, 17, 40, -1, 0, 63, 31, -1])
    mine = torch.zeros(2, 4, 16, 2, 64)
    theirs = mine.clone()
    MetalAttention(spec, METAL_KV_LAYOUT).write_kv(key, value, mine, slots)
    ReferenceAttention(spec, METAL_KV_LAYOUT).write_kv(key, value, theirs, slots)
    assert torch.equal(mine, theirs)
    assert int((mine[0].reshape(64, 2, 64).abs().sum((1, 2)) > 0).sum()) == 6  # 6 real tokens, 3 skipped


# -- the MPS defects and their workarounds -------------------------------------------------------


def _record(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Record the (q, k) shapes of every SDPA call the kernels make."""
    shapes: list[tuple[int, ...]] = []

    def recording(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
    ) -> torch.Tensor:
        shapes.append((*q.shape, k.shape[2]))
        return sdpa_attend(q, k, v, allowed, scale)

    monkeypatch.setattr(attention, "sdpa_attend", recording)
    return shapes


def test_a_no_sdpa_call_exceeds_the_element_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect (a): past 2^32 score elements MPS's SDPA aborts or is silently wrong; the kernels split."""
    shapes = _record(monkeypatch)
    limit = 8 * 64 * 6  # 8 heads x 64 keys x 6 query rows: forces splits of both batch and rows
    monkeypatch.setattr(attention, "SDPA_MAX_ELEMENTS", limit)
    check(make_batch([(1, 40), (1, 60), (1, 20), (50, 50), (1, 64)]))
    assert max(n * h * q * s for n, h, q, _, s in shapes) <= limit
    assert len(shapes) > 2 + 1  # split: more calls than the one decode batch and one prefill


def test_a_the_split_at_the_real_limit_on_meta_tensors() -> None:
    """A 32-head prefill of 16k x 16k tokens (2^33 scores) is cut into calls of at most 2^32."""
    calls: list[int] = []

    def fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
        calls.append(q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])
        return torch.empty(q.shape, device="meta")

    n = 16384
    q = torch.empty(1, 32, n, 128, device="meta")
    k = torch.empty(1, 8, n, 128, device="meta")
    allowed = torch.empty(1, 1, n, n, dtype=torch.bool, device="meta")
    out = bounded_attend(fake, q, k, k, allowed, 1.0)
    assert out.shape == q.shape and len(calls) == 2 and max(calls) <= 1 << 32 == attention.SDPA_MAX_ELEMENTS


@pytest.mark.parametrize("block_size", [8, 16])
def test_b_every_kv_length_is_a_multiple_of_32(block_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect (b): short queries read past the keys when S % 32 != 0; the keys are padded, masked."""
    shapes = _record(monkeypatch)
    check(make_batch([(1, 1), (1, 17), (1, 45), (3, 3), (2, 39), (40, 40)], block_size=block_size))
    assert shapes and all(s % 32 == 0 for *_, s in shapes), shapes
    assert aligned_kv_len(1) == 32 and aligned_kv_len(32) == 32 and aligned_kv_len(33) == 64
