"""Paged varlen batches full of traps, and the fp64 golden attention over them.

A batch is built from per-sequence ``(computed, new)`` token counts: sequence ``i`` has
``computed + new`` tokens of K/V in the cache and ``new`` query tokens in the call. The traps:

* block tables are random permutations of the cache's pages (never contiguous), and in the
  ``shared`` kind two sequences share their first pages (a prefix-cache hit or an ``n > 1`` fork);
* every page no sequence owns, and the unused tail of each sequence's last page, holds NaN;
  padded block-table entries point at NaN pages: any read past a sequence's length shows up as
  NaN in the output (``0 * NaN`` is NaN, so masking a score does not hide it);
* the query is a view into a larger NaN-guarded buffer (a storage offset, no data past its end).

The golden result is computed densely, per sequence, in fp64 from the rounded K/V, without any
paging: it checks the reference backend's paging as much as the backend's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from plinth.platform.backend import AttentionMetadata, AttentionSpec, KVCacheLayout, canonical_kv_view, torch_dtype

#: kv lengths of the ``long-decode`` kind: 16 sequences from one to three thousand keys, on both
#: sides of the powers of two where kernels switch to split-K / multi-partition paths.
LONG_DECODE_LENGTHS: tuple[int, ...] = (
    257,
    300,
    511,
    512,
    513,
    777,
    1000,
    1023,
    1025,
    1500,
    2047,
    2049,
    129,
    65,
    3001,
    1,
)

#: Value regimes of a batch: (query scale, key scale, value scale, softmax scale in units of
#: 1/sqrt(D)). ``large`` puts scores past 88 (exp overflows fp32 without the running maximum):
#: scores of std 45, so a decode batch's ~800 scores hold ~20 above 88 whatever the seed (suite 1.5;
#: 1.4's std 30 left about one, and the reseeded decode-vlarge case none),
#: ``small`` makes every operand tiny (absolute epsilons show), ``scale`` passes a softmax scale
#: that is not 1/sqrt(D) (a kernel that recomputes it fails), ``adversarial`` drives soft-capped
#: logits far into tanh's saturation (|score / cap| ~ 50: a tanh built from exp(2x) overflows).
REGIMES: dict[str, tuple[float, float, float, float]] = {
    "normal": (1.0, 1.0, 1.0, 1.0),
    "large": (45.0, 1.0, 1.0, 1.0),
    "small": (1e-2, 1e-2, 1e-3, 1.0),
    "scale": (1.0, 1.0, 1.0, 2.9),
    "adversarial": (80.0, 1.0, 1.0, 1.0),
}

#: The order of the reference layout; any declared layout is a permutation of these names.
CANONICAL_DIMS: tuple[str, ...] = ("kv", "num_blocks", "block_size", "num_kv_heads", "head_size")

#: Extra pages no sequence owns: padded block-table entries point at them.
SPARE_PAGES = 3


def canonical_view(cache: torch.Tensor, layout: KVCacheLayout, spec: AttentionSpec | None = None) -> torch.Tensor:
    """A ``[2, num_blocks, block_size, Hkv, D]`` view of ``cache`` stored in ``layout``
    (:func:`plinth.platform.backend.canonical_kv_view`; an interleaved layout needs ``spec``)."""
    if not layout.interleaved:
        return cache.permute([layout.dims.index(d) for d in CANONICAL_DIMS])
    if spec is None:
        raise ValueError(f"an interleaved KV layout {layout.dims} needs the attention spec to be viewed")
    return canonical_kv_view(cache, layout, spec.num_kv_heads, spec.head_size)


def zero_padding_features(cache: torch.Tensor, layout: KVCacheLayout, spec: AttentionSpec) -> None:
    """Zero the physical head size's padding features (the contract says they hold zeros)."""
    if layout.physical_head_size(spec.head_size) != spec.head_size:
        canonical_kv_view(cache, layout, spec.num_kv_heads, spec.head_size, physical=True)[..., spec.head_size :] = 0


def long_length(block_size: int) -> int:
    """The "long" sequence length for a block size: several pages and a partial one."""
    return max(3 * block_size + 5, 40)


def batch_lengths(kind: str, block_size: int) -> list[tuple[int, int]]:
    """``(computed, new)`` per sequence for a batch ``kind``, covering kv lengths 1, B-1, B, B+1, long.

    * ``prefill``: whole prompts; ``decode``: one new token each; ``mixed``: decodes, prompts and
      a prefill chunk after context in one call; ``chunked``: prefill chunks after context;
      ``shared``: like ``mixed``, but sequences 0 and 1 share their first pages.
    """
    b, long = block_size, long_length(block_size)
    table = {
        "prefill": [(0, 1), (0, b - 1), (0, b), (0, b + 1), (0, long)],
        "decode": [(0, 1), (b - 2, 1), (b - 1, 1), (b, 1), (long - 1, 1)],
        "mixed": [(b, 1), (0, b + 1), (b + 2, b - 1), (long - 1, 1), (0, 1), (b - 2, 1)],
        "chunked": [(1, b - 1), (b, b), (b - 1, 2), (long - b - 3, b + 3)],
        "shared": [(long - 1, 1), (long - b - 1, b + 1), (b - 1, 1), (0, b)],
        # path switches: long contexts, long prompts, a batch of 64 sequences, the sweep's small batch
        "long-decode": [(s - 1, 1) for s in LONG_DECODE_LENGTHS],
        "long-prefill": [(0, 333), (1200, 45), (700, 1), (2 * b + 1, 257)],
        "big-batch": [((7 * i) % (4 * b), 1) for i in range(48)]
        + [((11 * i) % (3 * b), 2 + i % (b + 2)) for i in range(16)],
        "sweep": [(0, 3), (b + 1, 1), (b - 2, 3)],
    }[kind]
    return [(c, n) for c, n in table if c >= 0 and n >= 1]


@dataclass(slots=True)
class PagedBatch:
    """One attention call's inputs, with the logical (unpaged) K/V for the golden computation."""

    spec: AttentionSpec
    query: torch.Tensor  # [T, H, D] in spec.dtype: a view into query_guard
    query_guard: torch.Tensor  # [T + 2, H, D]: NaN rows around the query
    keys: list[torch.Tensor]  # per sequence [S_i, Hkv, D] in spec.kv_cache_dtype
    values: list[torch.Tensor]
    pages: list[list[int]]  # per sequence, the pages holding its K/V
    meta: AttentionMetadata
    num_blocks: int
    scale: float

    def token_owner(self, token: int) -> tuple[int, int]:
        """``(sequence, position)`` of query token ``token``, for failure messages."""
        starts = self.meta.query_start_loc.tolist()
        for i in range(self.meta.num_seqs):
            if starts[i] <= token < starts[i + 1]:
                q_len = starts[i + 1] - starts[i]
                return i, self.meta.seq_lens_host[i] - q_len + (token - starts[i])
        return -1, -1


def _randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype)


def attention_metadata(
    q_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor, slots: list[int]
) -> AttentionMetadata:
    """The one place new suite code builds :class:`AttentionMetadata` (from host lists)."""
    return AttentionMetadata.from_lengths(
        list(q_lens), list(seq_lens), block_tables, slot_mapping=torch.tensor(slots, dtype=torch.int64)
    )


def build_batch(spec: AttentionSpec, kind: str, gen: torch.Generator, regime: str = "normal") -> PagedBatch:
    """A random batch of ``kind`` for ``spec`` (see :func:`batch_lengths`) in a value ``regime``
    (see :data:`REGIMES`)."""
    q_mag, k_mag, v_mag, scale_mult = REGIMES[regime]
    block = spec.block_size
    lengths = batch_lengths(kind, block)
    seq_lens = [c + n for c, n in lengths]
    n_pages = [math.ceil(s / block) for s in seq_lens]
    shared = min(n_pages[0], n_pages[1]) - 1 if kind == "shared" else 0  # pages seq 1 shares with seq 0
    shared = max(shared, 0)
    used = sum(n_pages) - shared
    num_blocks = used + SPARE_PAGES + used // 4
    order = torch.randperm(num_blocks, generator=gen).tolist()
    owned, spare = order[:used], order[used:]
    pages: list[list[int]] = []
    take = iter(owned)
    for i, n in enumerate(n_pages):
        first = pages[0][:shared] if i == 1 else []
        pages.append(first + [next(take) for _ in range(n - len(first))])
    kv_dtype = torch_dtype(spec.kv_cache_dtype)
    hkv, d = spec.num_kv_heads, spec.head_size
    keys = [_randn((s, hkv, d), kv_dtype, gen, k_mag) for s in seq_lens]
    values = [_randn((s, hkv, d), kv_dtype, gen, v_mag) for s in seq_lens]
    if shared:
        keys[1][: shared * block] = keys[0][: shared * block]
        values[1][: shared * block] = values[0][: shared * block]
    width = max(n_pages) + 2
    # padded entries: random spare (NaN) pages, drawn in one call (long batches pad thousands)
    pads = torch.tensor(spare)[torch.randint(len(spare), (len(pages), width), generator=gen)].tolist()
    table = torch.tensor([p + pad[: width - len(p)] for p, pad in zip(pages, pads, strict=True)], dtype=torch.int32)
    news = [n for _, n in lengths]
    meta = AttentionMetadata.from_lengths(news, seq_lens, table, block_size=block)
    num_tokens = sum(news)
    dtype = torch_dtype(spec.dtype)
    # Large queries make the softmax peaky (and the soft-cap bite); a real model's are like that.
    q_scale = (2.0 if spec.logits_soft_cap is not None and regime == "normal" else 1.0) * q_mag
    guard = torch.full((num_tokens + 2, spec.num_heads, d), float("nan"), dtype=dtype)
    guard[1 : num_tokens + 1] = _randn((num_tokens, spec.num_heads, d), dtype, gen, q_scale)
    return PagedBatch(
        spec=spec,
        query=guard[1 : num_tokens + 1],
        query_guard=guard,
        keys=keys,
        values=values,
        pages=pages,
        meta=meta,
        num_blocks=num_blocks,
        scale=scale_mult / math.sqrt(d),
    )


def fill_cache(cache: torch.Tensor, layout: KVCacheLayout, batch: PagedBatch) -> None:
    """NaN everywhere, then each sequence's K/V into its pages (through the layout's dims).

    A cache on an accelerator is filled on the host and copied over once.
    """
    if cache.device.type != "cpu":
        host = torch.empty(cache.shape, dtype=cache.dtype)
        fill_cache(host, layout, batch)
        cache.copy_(host)
        return
    cache.fill_(float("nan"))
    zero_padding_features(cache, layout, batch.spec)
    view = canonical_view(cache, layout, batch.spec)  # [2, NB, B, Hkv, D]
    block = batch.spec.block_size
    for pages, k, v in zip(batch.pages, batch.keys, batch.values, strict=True):
        pos = torch.arange(k.shape[0])
        page = torch.tensor(pages, dtype=torch.long)[pos // block]
        view[0, page, pos % block] = k.to(cache.dtype)
        view[1, page, pos % block] = v.to(cache.dtype)


def meta_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """``meta`` with its tensors on ``device`` (the host lists stay)."""
    if device.type == "cpu":
        return meta
    return replace(
        meta,
        query_start_loc=meta.query_start_loc.to(device),
        seq_lens=meta.seq_lens.to(device),
        block_tables=meta.block_tables.to(device),
        slot_mapping=meta.slot_mapping.to(device),
    )


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the oracle's many small ops on one thread, then restore the count.

    Why: on a loaded 2-core host, intra-op threading makes a 5x60 fp64 score product 40x slower
    (13 ms against 0.35 ms, threads waiting on each other); the golden and naive computations are
    thousands of such ops. The backend under test keeps its own thread count.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def golden_attention(batch: PagedBatch) -> torch.Tensor:
    """fp64 causal attention of each sequence's queries over its logical K/V -> [T, H, D] fp64."""
    spec, meta = batch.spec, batch.meta
    group = spec.num_heads // spec.num_kv_heads
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens_host):
        q = batch.query[starts[i] : starts[i + 1]].double()  # [Q, H, D]
        q = q.view(q.shape[0], spec.num_kv_heads, group, -1).permute(1, 2, 0, 3)  # [Hkv, g, Q, D]
        k = batch.keys[i].double().transpose(0, 1)  # [Hkv, S, D]: no K repeated per query head
        v = batch.values[i].double().transpose(0, 1)
        scores = torch.matmul(q, k[:, None].transpose(-1, -2)).flatten(0, 1) * batch.scale  # [H, Q, S]
        if spec.logits_soft_cap is not None:
            scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
        q_pos = torch.arange(seq_len - q.shape[2], seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = k_pos <= q_pos
        if spec.sliding_window is not None:
            allowed &= q_pos - k_pos < spec.sliding_window
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        pv = torch.matmul(probs.view(spec.num_kv_heads, group, *probs.shape[1:]), v[:, None])  # [Hkv, g, Q, D]
        out[starts[i] : starts[i + 1]] = pv.flatten(0, 1).transpose(0, 1)
    return out
