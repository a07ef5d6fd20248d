"""Hostile paged batches in the default KV layout, for the Triton kernels vs the reference backend.

Shuffled block ids; NaN in every page and page tail a sequence does not own; padding block-table
entries that point at NaN pages; NaN query rows for padding tokens past the batch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from plinth.platform.backend import AttentionMetadata, AttentionSpec, KVCacheLayout
from plinth.platform.reference import ReferenceAttention

SCALE = 0.2
PAD_TOKENS = 2


@dataclass
class PagedBatch:
    """A varlen batch over a paged cache [2, NB, bs, Hkv, D]."""

    spec: AttentionSpec
    query: torch.Tensor  # [T + PAD_TOKENS, H, D]
    kv_cache: torch.Tensor  # [2, NB, bs, Hkv, D]
    meta: AttentionMetadata

    def reference(self) -> torch.Tensor:
        """The reference backend's output, computed from an fp32 copy of the inputs."""
        spec = AttentionSpec(
            self.spec.num_heads,
            self.spec.num_kv_heads,
            self.spec.head_size,
            self.spec.block_size,
            sliding_window=self.spec.sliding_window,
            logits_soft_cap=self.spec.logits_soft_cap,
        )
        ref = ReferenceAttention(spec, KVCacheLayout())
        return ref.forward(self.query.float(), self.kv_cache.float(), self.meta, SCALE)


def paged_batch(
    cases: list[tuple[int, int]],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    seed: int = 0,
) -> PagedBatch:
    """``cases`` is ``[(q_len, seq_len), ...]``; each sequence's K/V is already in the cache."""
    kv_dtype = kv_dtype or dtype
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    spec = AttentionSpec(
        num_heads,
        num_kv_heads,
        head_size,
        block_size,
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
    need = [math.ceil(s / block_size) for _, s in cases]
    num_blocks = sum(need) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    nan_pages = free[sum(need) :]
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=kv_dtype)
    width = max(need) + 2
    tables = torch.empty(len(cases), width, dtype=torch.int32)
    for i, (n, (_, seq_len)) in enumerate(zip(need, cases, strict=True)):
        blocks = [free.pop(0) for _ in range(n)]
        tables[i] = torch.tensor(blocks + [rng.choice(nan_pages) for _ in range(width - n)])
        pos = torch.arange(seq_len)
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        cache[:, slots // block_size, slots % block_size] = torch.randn(
            2, seq_len, num_kv_heads, head_size, generator=gen
        ).to(kv_dtype)
    q_lens = [q for q, _ in cases]
    seq_lens = [s for _, s in cases]
    total = sum(q_lens)
    query = torch.randn(total + PAD_TOKENS, num_heads, head_size, generator=gen).to(dtype)
    query[total:] = float("nan")
    meta = AttentionMetadata.from_lengths(
        q_lens, seq_lens, tables, slot_mapping=torch.full((total + PAD_TOKENS,), -1, dtype=torch.int64)
    )
    return PagedBatch(spec, query, cache, meta)
