"""IPEX's paged attention (``ipex.llm.modules.PagedAttention``) over the cpu backend's KV cache.

No copy and no layout of its own: IPEX's CPU kernels keep each of K and V as
``[num_blocks, num_kv_heads, block_size, head_size]`` (the layout vLLM's CPU backend hands them),
which is exactly ``kv_cache[0]`` / ``kv_cache[1]`` of the cpu backend's head-major cache
(:data:`plinth_cpu.attention.CPU_KV_LAYOUT`, ``[2, num_blocks, Hkv, block_size, D]``), so the
engine's cache is read and written in place and the cpu backend's own kernels can share it.

One ``forward`` serves plinth's varlen batch in at most two IPEX calls, split on the host from the
step's decode-first :attr:`~plinth.platform.backend.AttentionMetadata.distribution`:

* the decodes (one query token each) through ``single_query_cached_kv_attention``, with a head
  mapping for GQA;
* every other sequence (prefills, chunks after cached context) through ``flash_attn_varlen_func``
  over the paged cache, causal with the queries aligned to the end of their keys (query ``j`` of a
  ``q``-token chunk of an ``s``-token sequence sits at position ``s - q + j``), which is plinth's rule.

A sliding window of ``w`` (plinth masks keys *further back than* ``w`` positions: a query at ``p``
sees keys ``p - w + 1 .. p``) is IPEX's ``window_size`` ``w`` in its decode kernel but its
``window_size_left`` ``w - 1`` in the varlen one: the two kernels count differently (found against the
reference: either other value is off by up to 2.3 on a unit-variance batch). A soft cap is its
``softcap``. What IPEX cannot run (a soft cap together with a window: its kernels refuse that pair; a
window of 1, which the varlen kernel's left window of 0 turns off: the conformance suite found it) is
declared by :meth:`IpexAttention.covers`, so the core keeps the cpu backend's kernel for it.

IPEX's ops are torch ops (``torch_ipex::*``): the core's step-graph capture sees them compute and
discards the capture, so decode steps with IPEX's kernels run eagerly (never replayed without them).
"""

from __future__ import annotations

from typing import Any

import torch

from plinth.platform.backend import AttentionKernels, AttentionMetadata, AttentionSpec, KVCacheLayout

#: Compute dtypes IPEX's paged attention runs here, each over a cache of the same dtype.
DTYPES = frozenset({"float32", "bfloat16"})


def _paged() -> Any:
    from intel_extension_for_pytorch.llm.modules import PagedAttention

    return PagedAttention


class IpexAttention(AttentionKernels):
    """KV write and paged attention by IPEX, over the cpu backend's head-major cache."""

    def __init__(self, spec: AttentionSpec, layout: KVCacheLayout) -> None:
        super().__init__(spec, layout)
        self._paged = _paged()
        group = spec.num_heads // spec.num_kv_heads
        #: query head -> its KV head, what the decode kernel takes for GQA
        self.head_mapping = torch.arange(spec.num_kv_heads, dtype=torch.int32).repeat_interleave(group)  # [H]
        # -1: no window; the two kernels count the window differently (module docstring)
        self.decode_window = -1 if spec.sliding_window is None else spec.sliding_window
        self.varlen_window = -1 if spec.sliding_window is None else spec.sliding_window - 1
        self.soft_cap = -1.0 if spec.logits_soft_cap is None else float(spec.logits_soft_cap)

    @staticmethod
    def covers(spec: AttentionSpec) -> str | None:
        """None where IPEX runs ``spec``; else the reason it does not (the cpu backend's kernel then)."""
        if spec.dtype not in DTYPES:
            return f"compute dtype {spec.dtype} (IPEX here: {', '.join(sorted(DTYPES))})"
        if spec.kv_cache_dtype != spec.dtype:
            return f"KV cache dtype {spec.kv_cache_dtype} differs from the compute dtype {spec.dtype}"
        if spec.sliding_window is not None and spec.logits_soft_cap is not None:
            return "a sliding window with a logits soft cap (IPEX's kernels refuse the pair)"
        if spec.sliding_window == 1:
            return "a sliding window of 1 (IPEX's varlen kernel takes its left window of 0 as no window)"
        if spec.num_heads % spec.num_kv_heads:
            return f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads"
        return None

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store ``key``/``value`` [T, Hkv, D] (any strides) at ``slot_mapping`` [T]; slots < 0 are skipped."""
        # IPEX's kernel indexes the rows densely, and writes a negative slot out of bounds (a
        # segfault, found with a step graph's padding rows): padding tokens are dropped here
        k, v = key.contiguous(), value.contiguous()
        if bool((slot_mapping < 0).any()):
            keep = (slot_mapping >= 0).nonzero().squeeze(1)  # [T']
            k, v, slot_mapping = k.index_select(0, keep), v.index_select(0, keep), slot_mapping.index_select(0, keep)
        self._paged.reshape_and_cache(k, v, kv_cache[0], kv_cache[1], slot_mapping)

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """``query`` [T, H, D] -> [T, H, D] over the cache; padding tokens' rows are left as zeros."""
        if meta.traced:
            raise ValueError("IpexAttention runs eagerly: a traced (compiled) step is not IPEX's")
        query = query.contiguous()
        out = torch.zeros_like(query)  # [T, H, D]
        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [num_blocks, Hkv, block_size, D] each
        d, _, n = meta.distribution_host or (0, 0, len(meta.seq_lens_host))
        # a batch not in decode-first order is described as all general (d = 0): always correct
        self._attend(out, query, key_cache, value_cache, meta, scale, d, n)
        return out

    def _attend(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        d: int,
        n: int,
    ) -> None:
        """Sequences ``[0, d)`` (decodes) and ``[d, n)`` (the rest) into ``out``."""
        if d:
            self._paged.single_query_cached_kv_attention(
                out[:d],
                query[:d],
                key_cache,
                value_cache,
                self.head_mapping,
                scale,
                meta.block_tables[:d],
                meta.seq_lens[:d],
                self.spec.block_size,
                max(meta.seq_lens_host[:d]),
                None,
                self.decode_window,
                1.0,
                1.0,
                self.soft_cap,
            )
        if n > d:
            t0 = d  # the decodes' tokens come first, one each
            q_lens = meta.query_lens_host[d:n]
            s_lens = meta.seq_lens_host[d:n]
            t1 = t0 + sum(q_lens)
            cu_q = meta.query_start_loc[d : n + 1] - t0  # [n - d + 1]
            cu_kv = torch.zeros(n - d + 1, dtype=torch.int32)
            torch.cumsum(meta.seq_lens[d:n], 0, out=cu_kv[1:])
            self._paged.flash_attn_varlen_func(
                out[t0:t1],
                query[t0:t1],
                key_cache,
                value_cache,
                cu_q,
                cu_kv,
                max(q_lens),
                max(s_lens),
                scale,
                True,
                meta.block_tables[d:n],
                None,
                self.varlen_window,
                -1,
                "auto",
                1.0,
                1.0,
                self.soft_cap,
            )
