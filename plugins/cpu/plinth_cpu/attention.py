"""Paged attention and KV-cache writes for the CPU backend, vectorised over the whole batch.

One ``forward`` serves any mix of prefill chunks and decodes. Sequences are split on the host
(from ``query_lens_host``, no tensor sync) into at most two groups, so a long prefill does not pad
every decode up to its query length:

* decodes (``q_len == 1``): the query heads of one KV head are folded into the rows of one small
  matmul (``[B, Hkv, group, D]``), so GQA needs no repeated K/V;
* prefill chunks (``q_len > 1``, possibly with earlier context): queries are padded to
  ``[B, max_q, H, D]`` with index tensors built from ``query_start_loc``, and one masked
  ``scaled_dot_product_attention`` call covers them all.

Each group gathers only the kv positions it needs (up to its longest sequence) into a dense
``[B, S, Hkv, D]`` copy, by slot index. Padding block-table entries and the unused tail of a
sequence's last page may hold garbage, even NaN, and a ``-inf`` score does not cancel a NaN value
(``0 * NaN`` is NaN): so positions past a sequence's length are redirected to its position 0 (a
real, finite entry) before the gather, and padding pages are never read at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plinth.platform.backend import AttentionKernels, AttentionMetadata


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything else (fp32, bf16, fp16) is computed in fp32, like the reference."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class CpuAttention(AttentionKernels):
    """KV write by one ``index_copy_`` per cache half; attention by batched torch ops.

    The cache has the default layout ``[2, num_blocks, block_size, Hkv, D]``.
    """

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store ``key``/``value`` ([T, Hkv, D]) at ``slot_mapping`` ([T]); slots < 0 are skipped."""
        keep = slot_mapping >= 0  # [T]; False for padding tokens
        slots = slot_mapping[keep].long()  # [T']
        key = key[keep].to(kv_cache.dtype)  # [T', Hkv, D]
        value = value[keep].to(kv_cache.dtype)
        if kv_cache.is_contiguous():
            # [2, NB, bs, Hkv, D] -> [2, NB*bs, Hkv, D]: a slot id is then a plain row index.
            flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
            flat[0].index_copy_(0, slots, key)
            flat[1].index_copy_(0, slots, value)
        else:
            # A strided cache cannot be flattened into a view; index (block, offset) instead.
            block_size = kv_cache.shape[2]
            index = (slots // block_size, slots % block_size)
            kv_cache[0].index_put_(index, key)
            kv_cache[1].index_put_(index, value)

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Paged attention: ``query`` [T, H, D] -> output [T, H, D] over the cached K/V.

        Tokens that belong to no sequence (padding past ``query_start_loc[-1]``) get zeros.
        """
        out = torch.zeros_like(query)  # [T, H, D]
        decodes: list[int] = []
        prefills: list[int] = []
        for i, q_len in enumerate(meta.query_lens_host):  # B host ints, never per token
            if q_len == 1:
                decodes.append(i)
            elif q_len > 1:
                prefills.append(i)
        for ids in (decodes, prefills):
            if ids:
                self._attend(query, kv_cache, meta, scale, ids, out)
        return out

    def _attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        ids: list[int],
        out: torch.Tensor,
    ) -> None:
        """Attention for the sequences ``ids`` (all decodes, or all prefill chunks), into ``out``."""
        num_heads, head_size = query.shape[1], query.shape[2]
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        group = num_heads // num_kv_heads
        acc = _accumulate_dtype(query.dtype)
        dev = query.device
        max_q = max(meta.query_lens_host[i] for i in ids)
        max_s = max(meta.seq_lens_host[i] for i in ids)
        n_blocks = -(-max_s // block_size)
        S = n_blocks * block_size

        G = len(ids)
        sel = torch.tensor(ids, dtype=torch.long, device=dev)  # [G]
        seq = torch.tensor([meta.seq_lens_host[i] for i in ids], dtype=torch.long, device=dev)  # [G]
        q_len = torch.tensor([meta.query_lens_host[i] for i in ids], dtype=torch.long, device=dev)
        start = meta.query_start_loc.index_select(0, sel).long()  # [G]

        # K/V: one slot index per (sequence, kv position). Positions past a sequence's length
        # read its position 0 instead: always a real, finite entry, so the -inf mask gives it an
        # exact zero weight. Padding table entries and stale page tails are never read.
        k_pos = torch.arange(S, device=dev)  # [S]
        pos = torch.where(k_pos[None, :] < seq[:, None], k_pos[None, :], 0)  # [G, S]
        tables = meta.block_tables.index_select(0, sel)[:, :n_blocks].long()  # [G, nb]
        slots = tables.gather(1, pos // block_size) * block_size + pos % block_size  # [G, S]
        # index_select copies whole [Hkv, D] rows; advanced indexing is ~20x slower here.
        # A view for the contiguous caches allocate_kv_cache makes (a strided one gets copied).
        flat = kv_cache.reshape(2, -1, num_kv_heads, head_size)  # [2, NB*bs, Hkv, D]
        k = flat[0].index_select(0, slots.flatten()).view(G, S, num_kv_heads, head_size).to(acc)
        v = flat[1].index_select(0, slots.flatten()).view(G, S, num_kv_heads, head_size).to(acc)
        k = k.permute(0, 2, 1, 3)  # [G, Hkv, S, D]
        v = v.permute(0, 2, 1, 3)

        # Queries, padded to max_q; a padding row repeats the sequence's last query token, so it
        # has a non-empty mask (no NaN) and is simply not copied out.
        j = torch.arange(max_q, device=dev)[None, :]  # [1, Q]
        j_clamped = torch.minimum(j, q_len[:, None] - 1)  # [G, Q]
        tok = start[:, None] + j_clamped  # [G, Q] token index into query/out
        q_pos = (seq - q_len)[:, None] + j_clamped  # [G, Q] absolute position of each query row
        allowed = k_pos[None, None, :] <= q_pos[:, :, None]  # [G, Q, S]; also excludes k_pos >= seq
        window = self.spec.sliding_window
        if window is not None:
            allowed &= q_pos[:, :, None] - k_pos[None, None, :] < window
        q = query.index_select(0, tok.flatten()).view(G, max_q, num_heads, head_size).to(acc)

        cap = self.spec.logits_soft_cap
        if cap is not None:
            # soft cap sits between QK^T and softmax, which SDPA cannot express: explicit math.
            # Fold the group's heads into rows: q [G, Hkv, group*Q, D] against k [G, Hkv, S, D].
            qf = q.view(G, max_q, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)
            qf = qf.reshape(G, num_kv_heads, group * max_q, head_size)
            scores = torch.matmul(qf, k.transpose(-1, -2)) * scale  # [G, Hkv, group*Q, S]
            scores = torch.tanh(scores / cap) * cap
            scores = scores.view(G, num_kv_heads, group, max_q, S)
            scores = scores.masked_fill_(~allowed[:, None, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(G, num_kv_heads, group * max_q, S)
            o = torch.matmul(probs, v).view(G, num_kv_heads, group, max_q, head_size)
            o = o.permute(0, 3, 1, 2, 4)  # [G, Q, Hkv, group, D]
        elif max_q == 1:
            # Decode fast path: the group's query heads are the rows, mask [G, 1, 1, S] broadcasts.
            qd = q.view(G, num_kv_heads, group, head_size)  # [G, Hkv, group, D]
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=allowed[:, None], scale=scale)
        else:
            # Prefill chunks: enable_gqa lets the mask [G, 1, Q, S] broadcast over all heads.
            qp = q.transpose(1, 2)  # [G, H, Q, D]
            o = F.scaled_dot_product_attention(
                qp, k, v, attn_mask=allowed[:, None], scale=scale, enable_gqa=group > 1
            )  # [G, H, Q, D]
            o = o.transpose(1, 2)  # [G, Q, H, D]

        o = o.reshape(G, max_q, num_heads, head_size).to(out.dtype)  # [G, Q, H, D]
        if max_q == 1:
            out.index_copy_(0, tok[:, 0], o[:, 0])
        else:
            real = j < q_len[:, None]  # [G, Q]; False for padding rows
            out.index_copy_(0, tok[real], o[real])
