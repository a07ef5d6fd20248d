"""The Triton attention and KV-write kernels against the reference backend, in the interpreter.

Shapes are small on purpose (the interpreter pays ~0.3 ms per op): head sizes 16-32 (and 80 for
the head-dim mask), a few heads, a few blocks. Every batch is hostile (see triton_batches.py).
"""

from __future__ import annotations

import pytest
import torch
from triton_batches import PAD_TOKENS, SCALE, PagedBatch, paged_batch

from plinth.platform.backend import AttentionSpec, KVCacheLayout
from plinth.platform.reference import ReferenceAttention

pytestmark = pytest.mark.triton_interpret

# Block size 16: kv lengths 1, B-1, B, B+1, several blocks; decodes, a chunk after context, a fresh
# prefill, a sequence with no tokens this step.
MIXED = [(1, 1), (1, 15), (5, 16), (1, 17), (12, 40), (0, 9), (3, 50), (20, 20)]


def _kernels(spec: AttentionSpec):  # noqa: ANN202 - TritonAttention, imported lazily like the backend does
    from plinth_triton.ops import InterpreterTarget, TritonAttention

    return TritonAttention(spec, KVCacheLayout(), InterpreterTarget())


def check(batch: PagedBatch, tol: float = 2e-5) -> torch.Tensor:
    """Finite, equal to the reference, zero for padding tokens; the cache left untouched."""
    cache_before = batch.kv_cache.clone()
    out = _kernels(batch.spec).forward(batch.query, batch.kv_cache, batch.meta, SCALE)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    assert torch.isfinite(out).all(), "NaN leaked from an unused page, a page tail or a padding token"
    torch.testing.assert_close(out.float(), batch.reference(), rtol=tol, atol=tol)
    assert (out[-PAD_TOKENS:] == 0).all()
    torch.testing.assert_close(batch.kv_cache, cache_before, equal_nan=True, rtol=0, atol=0)
    return out


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size",
    [(4, 2, 32), (4, 4, 16), (5, 1, 16), (2, 1, 80)],
    ids=["gqa2-d32", "mha-d16", "mqa5-d16", "gqa2-d80-masked"],
)
def test_mixed_batch(num_heads: int, num_kv_heads: int, head_size: int) -> None:
    """GQA, MHA, MQA with a non-power-of-two group, and a head size that needs the head-dim mask."""
    check(paged_batch(MIXED, num_heads, num_kv_heads, head_size))


@pytest.mark.parametrize("block_size", [32, 64])
def test_block_sizes(block_size: int) -> None:
    """Page boundaries at 1, B-1, B, B+1 tokens for the larger declared block sizes."""
    b = block_size
    cases = [(1, b - 1), (2, b), (1, b + 1), (b + 3, b + 3), (4, 2 * b + 5)]
    check(paged_batch(cases, block_size=block_size, seed=b))


def test_sliding_window_and_soft_cap() -> None:
    """A window narrower than a block and one across blocks; soft-cap alone and with a window."""
    check(paged_batch(MIXED, sliding_window=5, seed=1))
    check(paged_batch(MIXED, sliding_window=21, logits_soft_cap=3.0, seed=2))
    check(paged_batch(MIXED, logits_soft_cap=1.5, seed=3))


def test_split_kv_decode() -> None:
    """Pure decodes over long contexts take the split-KV path (+ reduction) and match."""
    from plinth_triton.configs import attention_config

    cases = [(1, 300), (1, 17), (1, 257)]
    assert max(s for _, s in cases) >= attention_config("interpreter").split_kv_min_len
    check(paged_batch(cases, 4, 2, 16, seed=4))
    check(paged_batch(cases, 4, 2, 16, sliding_window=40, seed=5))


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_precision(dtype: torch.dtype, tol: float) -> None:
    """bf16/fp16 query and cache: fp32 softmax and accumulation, rounded once on store."""
    check(paged_batch(MIXED[:5], dtype=dtype, seed=6), tol)


def test_fp32_query_over_bf16_cache() -> None:
    """A KV cache narrower than the compute dtype is read and upcast."""
    check(paged_batch(MIXED[:5], dtype=torch.float32, kv_dtype=torch.bfloat16, seed=7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_bit_exact(dtype: torch.dtype) -> None:
    """Slots written bit for bit (torch's rounding for a narrower cache), -1 skipped, nothing else touched."""
    num_blocks, block_size, hkv, d = 5, 16, 2, 32
    spec = AttentionSpec(4, hkv, d, block_size, kv_cache_dtype=str(dtype).removeprefix("torch."))
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:30]
    slots[[0, 11, 29]] = -1
    qkv = torch.randn(30, (4 + 2 * hkv) * d, generator=gen)  # fused projection: K/V are strided views
    key = qkv[:, 4 * d : (4 + hkv) * d].view(30, hkv, d)
    value = qkv[:, (4 + hkv) * d :].view(30, hkv, d)
    ours = torch.full((2, num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    ref = ours.clone()
    _kernels(spec).write_kv(key, value, ours, slots)
    ReferenceAttention(spec, KVCacheLayout()).write_kv(key, value, ref, slots)
    assert torch.equal(
        ours.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).flatten(),
        ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).flatten(),
    )


def test_write_then_forward() -> None:
    """write_kv followed by forward equals the reference doing both (a prefill then a decode)."""
    spec = AttentionSpec(4, 2, 32, 16)
    gen = torch.Generator().manual_seed(1)
    table = torch.tensor([[3, 1, 4]], dtype=torch.int32)
    outs = []
    for kernels in (_kernels(spec), ReferenceAttention(spec, KVCacheLayout())):
        cache = torch.full((2, 6, 16, 2, 32), float("nan"))
        gen.manual_seed(1)
        for start, n in ((0, 33), (33, 1)):
            pos = torch.arange(start, start + n)
            slots = table[0].long()[pos // 16] * 16 + pos % 16
            key, value = torch.randn(2, n, 2, 32, generator=gen)
            query = torch.randn(n, 4, 32, generator=gen)
            kernels.write_kv(key, value, cache, slots)
            from plinth.platform.backend import AttentionMetadata

            meta = AttentionMetadata.from_lengths([n], [start + n], table, slot_mapping=slots)
            outs.append(kernels.forward(query, cache, meta, SCALE))
    for ours, ref in zip(outs[:2], outs[2:], strict=True):
        torch.testing.assert_close(ours, ref, rtol=2e-5, atol=2e-5)
