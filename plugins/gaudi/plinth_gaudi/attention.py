"""Paged attention in the shape HPU graphs want: every tensor's shape fixed by the step's bucket.

Two paths, chosen by the step's shape (``AttentionMetadata.decode_only``), never by values, so a graph
captured for a shape always takes one:

* **decode** (one query token per sequence): *flat paged attention*. All the step's blocks are one
  list (:class:`~plinth.platform.backend.FlatBlocks`: block id, owning sequence, index in that
  sequence); one batched matmul scores every query against every block of its own sequence
  (``[NB, Hkv, G, block_size]``), a mask built from the block's index and the sequence's length hides
  the last block's unused slots (and, with a sliding window, the keys behind it). Each block is
  soft-maxed on its own (its own maximum), then rescaled to its sequence's maximum (the *group*
  maximum, a scatter-max over the blocks) and summed into its sequence: the per-sequence softmax,
  without a loop over sequences and without a ``[B, max_blocks]`` gather of mostly padding.
* **prefill** (any other step): the step's blocks gathered once, flat, and one fused
  ``scaled_dot_product_attention`` of every query token over them, with a mask that allows a token
  only its own sequence's keys at or before its position. Prefills from position 0, chunks after
  cached context and prefix-cache hits are the one case.

The KV cache is separate K and V, ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (the
contract's default layout: ``cache[0]`` and ``cache[1]`` are each one contiguous tensor). The write
is static-shape too: padding tokens (slot -1) write slot 0's own value back to it (slot 0 is the
null block's, which the scheduler never hands out), so one ``index_copy`` of every token serves.

Slots past a sequence's length (the last block's tail, padding entries) are zeroed before they
meet a matmul: whatever a stale slot holds (NaN included) never reaches an output. The softmax
runs in float32 whatever the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plinth.platform.backend import AttentionKernels, AttentionMetadata, FlatBlocks


def write_slots(flat: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """``flat[slots[t]] = values[t]`` for every ``slots[t] >= 0``, in one static-shape ``index_copy``.

    A padding token (slot < 0) writes slot 0's current value back to slot 0: the null block's
    first slot, never a real token's (see the module docstring).

    :param flat: ``[num_slots, Hkv, D]`` (one of K or V, slots flattened).
    :param values: ``[T, Hkv, D]``.
    :param slots: ``[T]`` int.
    """
    valid = slots >= 0
    index = torch.where(valid, slots, torch.zeros_like(slots)).long()
    kept = flat.index_select(0, index)
    flat.index_copy_(0, index, torch.where(valid[:, None, None], values.to(flat.dtype), kept))


def flat_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    flat: FlatBlocks,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Flat paged attention of one query token per sequence (see the module docstring).

    :param query: ``[B, H, D]``: sequence ``i``'s token is its last (position ``seq_lens[i] - 1``).
    :param key_cache: ``[num_blocks, block_size, Hkv, D]``; ``value_cache`` the same.
    :param flat: the step's flat block list (padding entries: group ``B``).
    :param seq_lens: ``[B]`` (0 for padding sequences, whose output is 0).
    :returns: ``[B, H, D]`` in ``query``'s dtype.
    """
    b, h, d = query.shape
    bs, hkv = key_cache.shape[1], key_cache.shape[2]
    g = h // hkv
    groups = flat.block_groups.long()
    nb = groups.shape[0]
    keys = key_cache.index_select(0, flat.block_list.long())  # [NB, bs, Hkv, D]
    values = value_cache.index_select(0, flat.block_list.long())
    q = torch.cat([query, query.new_zeros(1, h, d)]).index_select(0, groups).view(nb, hkv, g, d)
    scores = torch.einsum("nhgd,nshd->nhgs", q.float(), keys.float()) * scale  # [NB, Hkv, G, bs]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    lens = torch.cat([seq_lens.long(), seq_lens.new_zeros(1).long()]).index_select(0, groups)  # [NB]
    pos = flat.block_index.long()[:, None] * bs + torch.arange(bs, device=query.device)  # [NB, bs]
    valid = pos < lens[:, None]
    if sliding_window is not None:
        valid &= pos > lens[:, None] - 1 - sliding_window
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    values = values.masked_fill(~valid[:, :, None, None], 0)  # a stale slot's NaN must not reach 0 * NaN
    block_max = scores.amax(-1)  # [NB, Hkv, G]; -inf for a block with no valid slot
    group_max = torch.full((b + 1, hkv, g), float("-inf"), device=query.device)
    group_max = group_max.scatter_reduce(0, groups[:, None, None].expand(nb, hkv, g), block_max, "amax")
    group_max = torch.where(torch.isfinite(group_max), group_max, torch.zeros_like(group_max))
    safe_max = torch.where(torch.isfinite(block_max), block_max, torch.zeros_like(block_max))
    probs = torch.exp(scores - safe_max[..., None])  # the block's own softmax numerator
    block_sum = probs.sum(-1)
    block_out = torch.einsum("nhgs,nshd->nhgd", probs, values.float())
    rescale = torch.exp(block_max - group_max.index_select(0, groups))  # 0 for a fully masked block
    num = torch.zeros(b + 1, hkv, g, d, device=query.device).index_add_(0, groups, block_out * rescale[..., None])
    den = torch.zeros(b + 1, hkv, g, device=query.device).index_add_(0, groups, block_sum * rescale)
    out = num[:b] / den[:b].clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out.reshape(b, h, d).to(query.dtype)


def flat_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    flat: FlatBlocks,
    meta: AttentionMetadata,
    scale: float,
    *,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Every query token of the step over its own sequence's keys, in one fused SDPA over the
    step's flat blocks (see the module docstring).

    :param query: ``[T, H, D]``; token ``t`` of sequence ``i`` sits at position
        ``seq_lens[i] - (query_start_loc[i + 1] - t)``; padding tokens (past the last sequence's)
        get a finite, meaningless output.
    :returns: ``[T, H, D]``.
    """
    t, h, d = query.shape
    bs, hkv = key_cache.shape[1], key_cache.shape[2]
    device = query.device
    block_list = flat.block_list.long()
    nkeys = block_list.shape[0] * bs
    keys = key_cache.index_select(0, block_list).reshape(nkeys, hkv, d)
    values = value_cache.index_select(0, block_list).reshape(nkeys, hkv, d)
    starts = meta.query_start_loc.long()  # [B + 1]
    lens = torch.cat([meta.seq_lens.long(), meta.seq_lens.new_zeros(1).long()])  # [B + 1]: group B is empty
    ends = torch.cat([starts[1:], starts[-1:]])  # [B + 1]
    token = torch.arange(t, device=device)
    seq = torch.searchsorted(starts[1:].contiguous(), token, right=True)  # [T]: B for padding tokens
    q_pos = lens.index_select(0, seq) - (ends.index_select(0, seq) - token)  # [T]
    k_seq = flat.block_groups.long().repeat_interleave(bs)  # [K]
    k_pos = (flat.block_index.long()[:, None] * bs + torch.arange(bs, device=device)).reshape(-1)
    allowed = (k_seq[None, :] == seq[:, None]) & (k_pos[None, :] <= q_pos[:, None])
    live = k_pos < lens.index_select(0, k_seq)  # [K]: slots inside their sequence
    allowed &= live[None, :]
    keys = keys.masked_fill(~live[:, None, None], 0)  # stale slots (NaN garbage) never reach a score
    values = values.masked_fill(~live[:, None, None], 0)
    if sliding_window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
    # a padding token's row would be all masked (NaN in SDPA): let it see key 0; its output is dropped
    allowed[:, 0] |= ~allowed.any(-1)
    q = query.transpose(0, 1)[None]  # [1, H, T, D]
    k = keys.transpose(0, 1)[None]  # [1, Hkv, K, D]
    v = values.transpose(0, 1)[None]
    if soft_cap is None:
        out = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=allowed, scale=scale, enable_gqa=hkv != h
        )
    else:  # SDPA has no soft-cap: the same mask on explicit scores
        g = h // hkv
        qg = q.float().reshape(1, hkv, g * t, d)
        scores = (qg @ k.float().transpose(-1, -2)).view(1, hkv, g, t, nkeys) * scale
        scores = soft_cap * torch.tanh(scores / soft_cap)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out = (probs.view(1, hkv, g * t, nkeys) @ v.float()).view(1, h, t, d)
    return out[0].transpose(0, 1).to(query.dtype)


class GaudiAttention(AttentionKernels):
    """Flat paged attention for decode steps, fused SDPA for prefill steps; static-shape writes."""

    def _halves(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return kv_cache[0], kv_cache[1]

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        k_cache, v_cache = self._halves(kv_cache)
        nslots = k_cache.shape[0] * k_cache.shape[1]
        write_slots(k_cache.view(nslots, *k_cache.shape[2:]), key, slot_mapping)
        write_slots(v_cache.view(nslots, *v_cache.shape[2:]), value, slot_mapping)

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        k_cache, v_cache = self._halves(kv_cache)
        flat = FlatBlocks.from_metadata(meta, self.spec.block_size)
        options = {"soft_cap": self.spec.logits_soft_cap, "sliding_window": self.spec.sliding_window}
        if meta.decode_only:  # token i is sequence i's (T == B): the output needs no scatter
            return flat_decode(query, k_cache, v_cache, flat, meta.seq_lens, scale, **options)
        return flat_prefill(query, k_cache, v_cache, flat, meta, scale, **options)
