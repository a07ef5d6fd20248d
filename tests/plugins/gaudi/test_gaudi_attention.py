"""The gaudi kernels against the reference: flat paged attention (decode), fused SDPA over the flat
blocks (prefill), the static-shape KV write."""

from __future__ import annotations

import pytest
import torch
from plinth_gaudi.attention import GaudiAttention, flat_decode, write_slots

from plinth.platform.backend import AttentionMetadata, AttentionSpec, FlatBlocks, KVCacheLayout
from plinth.platform.reference import ReferenceAttention

LAYOUT = KVCacheLayout()
NUM_BLOCKS = 48


def _batch(
    query_lens: list[int], seq_lens: list[int], block: int, gen: torch.Generator
) -> tuple[list[list[int]], AttentionMetadata]:
    """Block tables over a random permutation of the pages (block 0 never used), and the metadata."""
    order = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    tables, k = [], 0
    for s in seq_lens:
        n = -(-s // block)
        tables.append(order[k : k + n])
        k += n
    return tables, AttentionMetadata.from_lengths(query_lens, seq_lens, tables, block_size=block)


CASES = {
    "decode": ([1, 1, 1, 1, 1], [1, 16, 17, 40, 64]),
    "prefill": ([7, 16, 1], [7, 16, 1]),
    "chunks-after-context": ([5, 1, 20, 3], [21, 30, 20, 50]),
}


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize(
    "heads,window,cap", [((4, 4), None, None), ((8, 2), None, None), ((8, 2), 5, None), ((6, 3), None, 20.0)]
)
def test_kernels_match_the_reference(kind: str, heads: tuple[int, int], window: int | None, cap: float | None) -> None:
    gen = torch.Generator().manual_seed(7)
    spec = AttentionSpec(heads[0], heads[1], 64, 16, sliding_window=window, logits_soft_cap=cap)
    query_lens, seq_lens = CASES[kind]
    _, meta = _batch(query_lens, seq_lens, 16, gen)
    assert meta.decode_only == (kind == "decode")  # which path ran
    cache = torch.randn(2, NUM_BLOCKS, 16, heads[1], 64, generator=gen)
    query = torch.randn(sum(query_lens), heads[0], 64, generator=gen)
    want = ReferenceAttention(spec, LAYOUT).forward(query, cache, meta, 0.125)
    got = GaudiAttention(spec, LAYOUT).forward(query, cache, meta, 0.125)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_the_group_maximum_rescale_keeps_blocks_of_far_apart_scores_exact() -> None:
    """One sequence's scores differ by ~200 between its blocks: a sum of per-block softmaxes
    without the rescale to the group maximum would be off by a factor of e^200 (or overflow)."""
    gen = torch.Generator().manual_seed(3)
    spec = AttentionSpec(2, 1, 64, 16)
    _, meta = _batch([1, 1], [40, 20], 16, gen)
    cache = torch.randn(2, NUM_BLOCKS, 16, 1, 64, generator=gen)
    query = torch.randn(2, 2, 64, generator=gen)
    first = meta.block_tables[0, 0].item()
    cache[0, first] += 40.0 * query[0, 0] / query[0, 0].norm()  # block 0 of sequence 0 scores far higher
    want = ReferenceAttention(spec, LAYOUT).forward(query, cache, meta, 1.0)
    got = GaudiAttention(spec, LAYOUT).forward(query, cache, meta, 1.0)
    assert torch.isfinite(got).all()
    # The top scores are ~320, where float32's spacing is 3e-5: a score rounded one way or the other
    # moves its softmax weight by that much relative, so the bound is a few of those spacings at the
    # top score (1.5e-4; a CI host measured 4.4e-5). A missing rescale would be off by e^200.
    top = float(torch.einsum("hd,sd->hs", query[0], cache[0, first, :, 0]).abs().max())  # [H, bs]
    assert top > 250.0  # the case is what its name says
    tol = 4 * torch.finfo(torch.float32).eps * top
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_padding_sequences_and_padding_blocks_give_zeros_not_nans() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, NUM_BLOCKS, 16, 2, 64, generator=gen)
    seq_lens = torch.tensor([17, 0, 0], dtype=torch.int32)  # two padding sequences
    flat = FlatBlocks.build([17, 0, 0], [[5, 6], [0], [0]], 16, pad_to=8)
    assert flat.block_groups.tolist() == [0, 0] + [3] * 6
    out = flat_decode(torch.randn(3, 4, 64, generator=gen), cache[0], cache[1], flat, seq_lens, 0.125)
    assert torch.isfinite(out).all() and out[1:].abs().max() == 0


def test_padding_tokens_write_nowhere_and_real_ones_exactly() -> None:
    gen = torch.Generator().manual_seed(2)
    flat = torch.randn(64, 2, 8, generator=gen)
    before = flat.clone()
    values = torch.randn(5, 2, 8, generator=gen)
    slots = torch.tensor([9, -1, 40, -1, 63])
    write_slots(flat, values, slots)
    assert torch.equal(flat[[9, 40, 63]], values[[0, 2, 4]])
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[[9, 40, 63]] = False
    assert torch.equal(flat[untouched], before[untouched])  # slot 0 (the padding tokens' target) included


def test_bfloat16_decode_and_prefill_stay_within_bf16_error() -> None:
    gen = torch.Generator().manual_seed(5)
    spec = AttentionSpec(8, 2, 128, 16, dtype="bfloat16", kv_cache_dtype="bfloat16")
    for query_lens, seq_lens in CASES.values():
        _, meta = _batch(query_lens, seq_lens, 16, gen)
        cache = torch.randn(2, NUM_BLOCKS, 16, 2, 128, generator=gen).bfloat16()
        query = torch.randn(sum(query_lens), 8, 128, generator=gen).bfloat16()
        want = ReferenceAttention(AttentionSpec(8, 2, 128, 16), LAYOUT).forward(
            query.float(), cache.float(), meta, 0.088
        )
        got = GaudiAttention(spec, LAYOUT).forward(query, cache, meta, 0.088)
        assert got.dtype == torch.bfloat16
        assert (got.float() - want).abs().max() < 2e-2
