"""Paged attention over the varlen batch in plain torch, shaped around MPS's known defects.

Each sequence's pages are gathered (``index_select`` of its block-table row) into a contiguous
``[S, Hkv, D]`` run and attended with ``scaled_dot_product_attention``; the decodes of a step (one
query token each) are gathered together and attended in one batched call. A logits soft-cap, which
SDPA cannot express, takes the matmul/softmax path instead.

The MPS defects designed around, each with a test in ``tests/plugins/metal/test_metal_attention.py``:

(a) SDPA (and MPSGraph's matmul under it) aborts, or silently returns wrong values, when one call's
    score matrix has more than 2^32 elements (32-bit indexing): :func:`bounded_attend` splits the
    batch and then the query rows so that no call exceeds :data:`SDPA_MAX_ELEMENTS`.
(b) MPS's SDPA kernel for short queries reads past the end of the keys when the KV length is not a
    multiple of 32: the gathered keys are padded to a multiple of :data:`KV_ALIGN` with masked
    slots (:func:`aligned_kv_len`), for every query length (one path, and the padding costs < 32
    keys per sequence).
(c) the 4 GB single-allocation limit: enforced where the cache is allocated
    (:meth:`plinth_metal.backend.MetalBackend.allocate_kv_cache`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from plinth.platform.backend import AttentionKernels, AttentionMetadata

#: Defect (a): no single SDPA/matmul call may have a score matrix of more elements than this.
#: Read at call time (tests lower it to show the split is taken).
SDPA_MAX_ELEMENTS = 1 << 32
#: Defect (b): the gathered KV length is padded to a multiple of this, the pad slots masked.
KV_ALIGN = 32

#: ``(q [N, H, Q, D], k [N, Hkv, S, D], v, allowed [N, 1, Q, S] bool, scale) -> [N, H, Q, D]``
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def aligned_kv_len(kv_len: int, align: int | None = None) -> int:
    """``kv_len`` rounded up to a multiple of :data:`KV_ALIGN` (defect (b))."""
    a = KV_ALIGN if align is None else align
    return -(-kv_len // a) * a


def sdpa_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """One SDPA call; GQA by ``enable_gqa`` (no repeated K/V in memory)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def matmul_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Scores by matmul, soft-cap, mask, softmax in fp32, then the value matmul. GQA by grouping the
    query heads of each kv head (``[N, Hkv, G*Q, D]``), so K/V are never repeated."""
    n, h, ql, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qg = q.reshape(n, hkv, g * ql, d)  # query heads of kv head j are j*g .. j*g+g-1
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [N, Hkv, G*Q, S]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    scores = scores.view(n, hkv, g, ql, -1).masked_fill(~allowed[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(n, hkv, g * ql, -1)
    return torch.matmul(probs, v).view(n, h, ql, d)


def bounded_attend(
    fn: AttendFn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """``fn`` over the batch, split so that no call's score matrix (N * H * Q * S) exceeds
    :data:`SDPA_MAX_ELEMENTS` (defect (a)): first along the batch, then along the query rows."""
    limit = SDPA_MAX_ELEMENTS
    n, h, ql, _ = q.shape
    s = k.shape[2]
    if n * h * ql * s <= limit:
        return fn(q, k, v, allowed, scale)
    if h * s > limit:
        raise ValueError(f"one query row attends {h} heads x {s} keys = {h * s} scores, over MPS's limit of {limit}")
    if n > 1:
        step = max(1, limit // (h * ql * s))
        parts = [
            bounded_attend(fn, q[i : i + step], k[i : i + step], v[i : i + step], allowed[i : i + step], scale)
            for i in range(0, n, step)
        ]
        return torch.cat(parts, dim=0)
    rows = limit // (h * s)
    parts = [fn(q[:, :, i : i + rows], k, v, allowed[:, :, i : i + rows], scale) for i in range(0, ql, rows)]
    return torch.cat(parts, dim=2)


class MetalAttention(AttentionKernels):
    """KV write by ``index_copy_`` of the slot mapping; attention by page gather + SDPA."""

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        # kv_cache: [2, NB, bs, Hkv, D] -> rows [NB * bs, Hkv, D]
        _, nb, bs, hkv, d = kv_cache.shape
        keep = slot_mapping >= 0  # slots < 0 are padding tokens: skipped
        slots = slot_mapping[keep]
        kv_cache[0].view(nb * bs, hkv, d).index_copy_(0, slots, key[keep].to(kv_cache.dtype))
        kv_cache[1].view(nb * bs, hkv, d).index_copy_(0, slots, value[keep].to(kv_cache.dtype))

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        # query: [T, H, D]; kv_cache: [2, NB, bs, Hkv, D]
        out = torch.zeros_like(query)  # rows of padding tokens stay 0, as the reference's
        qlens, seq_lens = meta.query_lens_host, meta.seq_lens_host  # host copies: no device sync
        offsets = [0]
        for n in qlens:
            offsets.append(offsets[-1] + n)
        decodes = [i for i, n in enumerate(qlens) if n == 1 and seq_lens[i] > 0]
        if decodes:  # all one-token queries in one batched call, wherever they sit in the batch
            rows = torch.tensor([offsets[i] for i in decodes], device=query.device)
            out[rows] = self._decodes(query[rows], kv_cache, meta, decodes, scale)
        for i, n in enumerate(qlens):
            if n > 1:
                out[offsets[i] : offsets[i + 1]] = self._sequence(
                    query[offsets[i] : offsets[i + 1]], kv_cache, meta, i, scale
                )
        return out

    def _attend_fn(self) -> AttendFn:
        cap = self.spec.logits_soft_cap
        if cap is None:
            return sdpa_attend
        return lambda q, k, v, allowed, scale: matmul_attend(q, k, v, allowed, scale, cap)

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, lens: list[int], kv_len: int) -> torch.Tensor:
        """``cache`` [NB, bs, Hkv, D] pages ``blocks`` [N, W] of sequences of ``lens`` (host ints) tokens ->
        [N, Hkv, kv_len, D], every slot at or past a sequence's length zero.

        Block-table entries past a sequence's pages are padding (any value, even out of range): they
        read block 0 instead. The slots past the length (a page's unwritten tail, the padding pages,
        the pad to :data:`KV_ALIGN`) are zeroed, not only masked: a masked score still multiplies its
        value, and 0 * NaN would poison the row. Both masks are built on the host from host lengths
        (no device sync), and the zeroing writes only those slots: a ``torch.where`` over the whole
        gather cost 40% of a 16 x 1024 decode step on the CPU (profiled).
        """
        n, w = blocks.shape
        _, bs, hkv, d = cache.shape
        lens_t = torch.tensor(lens)[:, None]  # [N, 1], host
        owned = (torch.arange(w)[None, :] * bs < lens_t).to(blocks.device)  # [N, W]
        index = torch.where(owned, blocks, torch.zeros_like(blocks)).reshape(-1).long()
        pages = cache.index_select(0, index).view(n, w * bs, hkv, d)
        if w * bs < kv_len:
            pages = F.pad(pages, (0, 0, 0, 0, 0, kv_len - w * bs))
        pages = pages[:, :kv_len]
        rows, cols = torch.nonzero(torch.arange(kv_len)[None, :] >= lens_t, as_tuple=True)  # host
        pages[rows.to(cache.device), cols.to(cache.device)] = 0
        return pages.transpose(1, 2)

    def _decodes(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, seqs: list[int], scale: float
    ) -> torch.Tensor:
        """Every one-token query in one batched call: q [N, H, D] -> [N, H, D]."""
        bs = kv_cache.shape[2]
        lens = [meta.seq_lens_host[i] for i in seqs]
        width = -(-max(lens) // bs)
        kv_len = aligned_kv_len(max(lens))  # defect (b)
        index = torch.tensor(seqs, device=meta.block_tables.device)
        blocks = meta.block_tables.index_select(0, index)[:, :width]
        seq_len = torch.tensor(lens, device=q.device)[:, None]  # [N, 1]
        k = self._gather(kv_cache[0], blocks, lens, kv_len).to(q.dtype)  # [N, Hkv, S, D]
        v = self._gather(kv_cache[1], blocks, lens, kv_len).to(q.dtype)
        pos = torch.arange(kv_len, device=q.device)[None, :]  # [1, S]
        allowed = pos < seq_len  # the query sits at seq_len - 1: every written key, no pad slot
        if self.spec.sliding_window is not None:
            allowed &= pos > seq_len - 1 - self.spec.sliding_window
        o = bounded_attend(self._attend_fn(), q[:, :, None], k, v, allowed[:, None, None], scale)
        return o[:, :, 0]

    def _sequence(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, i: int, scale: float
    ) -> torch.Tensor:
        """One sequence's chunk: q [Q, H, D] -> [Q, H, D]."""
        bs = kv_cache.shape[2]
        seq_len = meta.seq_lens_host[i]
        ql = q.shape[0]
        kv_len = aligned_kv_len(seq_len)  # defect (b)
        blocks = meta.block_tables[i : i + 1, : -(-seq_len // bs)]
        k = self._gather(kv_cache[0], blocks, [seq_len], kv_len).to(q.dtype)  # [1, Hkv, S, D]
        v = self._gather(kv_cache[1], blocks, [seq_len], kv_len).to(q.dtype)
        q_pos = torch.arange(seq_len - ql, seq_len, device=q.device)[:, None]  # [Q, 1]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]  # [1, S]
        allowed = k_pos <= q_pos  # causal; pad slots (>= seq_len > q_pos) masked with it
        if self.spec.sliding_window is not None:
            allowed &= q_pos - k_pos < self.spec.sliding_window
        o = bounded_attend(self._attend_fn(), q.transpose(0, 1)[None], k, v, allowed[None, None], scale)
        return o[0].transpose(0, 1)
