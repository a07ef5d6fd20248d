"""Broken backends the suite of 1.1 passed (issue 17): each is the reference backend with one bug on
a path the old cases never reached, declaring honest-looking capabilities.

Copied next to :mod:`broken_backends` onto ``sys.path`` by test_broken_paths.py; each registers
through its own ``plinth.backends`` entry point, like an installed plugin.
"""

from __future__ import annotations

import math

import torch
from plinth_broken_backends import _BlockGemm, _Broken, _fields, _Plugin  # the copy of broken_backends.py

from plinth.platform.backend import (
    AttentionMetadata,
    Capabilities,
    LinearWeight,
    SmallOps,
)
from plinth.platform.reference import ReferenceAttention, ReferenceGemm


class _Dense(ReferenceAttention):
    """Correct paged attention, one sequence at a time, with each step a method a bug overrides."""

    def kv_head_of(self, num_heads: int, num_kv_heads: int) -> list[int]:
        """The KV head each query head reads."""
        return [h // (num_heads // num_kv_heads) for h in range(num_heads)]

    def cap(self, scores: torch.Tensor, cap: float) -> torch.Tensor:
        return cap * torch.tanh(scores / cap)

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores, dim=-1)

    def window_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
        return q_pos - k_pos < window

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
               cap: float | None) -> torch.Tensor:  # fmt: skip
        """``q`` [Q, H, D], ``k``/``v`` [S, H, D], ``allowed`` [Q, S] -> [Q, H, D]."""
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if cap is not None:
            scores = self.cap(scores, cap)
        probs = self.softmax(scores.masked_fill(~allowed, float("-inf")))
        return torch.einsum("hqk,khd->qhd", probs, v)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float):  # noqa: ANN201
        return self.dense(query, kv_cache, meta, scale, self.spec.logits_soft_cap)

    def dense(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
              cap: float | None) -> torch.Tensor:  # fmt: skip
        out = torch.zeros_like(query)
        block, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        heads = torch.tensor(self.kv_head_of(query.shape[1], num_kv_heads))
        starts = meta.query_start_loc.tolist()
        for i, seq_len in enumerate(meta.seq_lens_host):
            q = query[starts[i] : starts[i + 1]].float()
            pages = meta.block_tables[i, : math.ceil(seq_len / block)].long()
            k = kv_cache[0, pages].flatten(0, 1)[:seq_len].float()[:, heads]  # [S, H, D]
            v = kv_cache[1, pages].flatten(0, 1)[:seq_len].float()[:, heads]
            q_pos = torch.arange(seq_len - q.shape[0], seq_len)[:, None]
            k_pos = torch.arange(seq_len)[None, :]
            allowed = k_pos <= q_pos
            if self.spec.sliding_window is not None:
                allowed &= self.window_mask(q_pos, k_pos, self.spec.sliding_window)
            out[starts[i] : starts[i + 1]] = self.attend(q, k, v, allowed, scale, cap).to(query.dtype)
        return out


class _Tiles8Heads(_Dense):
    def kv_head_of(self, num_heads: int, num_kv_heads: int) -> list[int]:
        group = num_heads // num_kv_heads
        if group <= 8:
            return super().kv_head_of(num_heads, num_kv_heads)
        return [(h // 8) % num_kv_heads for h in range(num_heads)]  # the bug: an 8-head tile per KV head


class _PairsOfKVHeads(_Dense):
    def kv_head_of(self, num_heads: int, num_kv_heads: int) -> list[int]:
        heads = super().kv_head_of(num_heads, num_kv_heads)
        if num_kv_heads % 2 and num_kv_heads > 1:  # the bug: KV heads two at a time, no odd remainder
            heads = [num_kv_heads - 2 if h == num_kv_heads - 1 else h for h in heads]
        return heads


class _HeadTail16(_Dense):
    def attend(self, q, k, v, allowed, scale, cap):  # noqa: ANN001, ANN201
        d = q.shape[-1] // 16 * 16  # the bug: a 16-wide D loop for QK^T without the remainder (PV is right)
        return super().attend(q[..., :d], k[..., :d], v, allowed, scale, cap)


class _SplitKAverages(_Dense):
    def attend(self, q, k, v, allowed, scale, cap):  # noqa: ANN001, ANN201
        if k.shape[0] <= 512:
            return super().attend(q, k, v, allowed, scale, cap)
        # the bug: split-K partitions of 512 keys averaged, not weighted by their softmax sums
        parts = []
        for s0 in range(0, k.shape[0], 512):
            part_allowed = allowed[:, s0 : s0 + 512]
            if part_allowed.any():
                parts.append(super().attend(q, k[s0 : s0 + 512], v[s0 : s0 + 512], part_allowed, scale, cap))
        return torch.stack(parts).nan_to_num().mean(0)


class _SoftmaxWithoutMax(_Dense):
    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        e = scores.exp()  # the bug: no running maximum subtracted (exp overflows past 88)
        return e / e.sum(-1, keepdim=True)


class _TanhFromExp(_Dense):
    def cap(self, scores: torch.Tensor, cap: float) -> torch.Tensor:
        e = torch.exp(2 * scores / cap)  # the bug: tanh as (e^2x - 1) / (e^2x + 1): inf / inf past x = 44
        return cap * (e - 1) / (e + 1)


class _RecomputesScale(_Dense):
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float):  # noqa: ANN201
        # the bug: the scale argument ignored, 1/sqrt(D) recomputed
        return self.dense(query, kv_cache, meta, query.shape[-1] ** -0.5, self.spec.logits_soft_cap)


class _AlignedWindowOffByOne(_Dense):
    def window_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
        block = self.spec.block_size
        if window % block == 0:  # the bug: a whole-block skip that keeps one key too many
            return q_pos - k_pos <= window
        return super().window_mask(q_pos, k_pos, window)


class _NoCapInDecode(_Dense):
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float):  # noqa: ANN201
        cap = None if meta.max_query_len == 1 else self.spec.logits_soft_cap  # the bug: the decode kernel lacks it
        return self.dense(query, kv_cache, meta, scale, cap)


class _LastBitWobbles(_Dense):
    calls = 0

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float):  # noqa: ANN201
        out = super().forward(query, kv_cache, meta, scale)
        type(self).calls += 1
        # the bug: a reduction order that changes between calls (one ulp, far inside any tolerance)
        return torch.nextafter(out, torch.full_like(out, math.inf)) if self.calls % 2 == 0 else out


class _TruncatesToBf16(ReferenceAttention):
    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:  # noqa: ANN001
        if kv_cache.dtype == torch.bfloat16 and key.dtype == torch.float32:
            # the bug: fp32 -> bf16 by dropping the low 16 bits (truncation, not round-to-nearest)
            def trunc(t: torch.Tensor) -> torch.Tensor:
                return (t.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

            key, value = trunc(key), trunc(value)
        super().write_kv(key, value, kv_cache, slot_mapping)


class _ValueUsesKeyStrides(ReferenceAttention):
    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:  # noqa: ANN001
        # the bug: one stride set for both operands (right when they share a layout, as in a fused qkv)
        value = torch.as_strided(value, value.shape, key.stride(), value.storage_offset())
        super().write_kv(key, value, kv_cache, slot_mapping)


class _CopiesKeysOnly(ReferenceAttention):
    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        for cache in kv_caches:
            for src, dst in pairs:
                cache[0, dst] = cache[0, src]  # the bug: the V half is not copied


class _DropsRowTail(ReferenceGemm):
    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        out = super().linear(x, weight)
        m = x.shape[0]
        if m > 256 and m % 64:
            out[m // 64 * 64 :] = 0  # the bug: the big-M path's 64-row tiles, no remainder tile
        return out


class _Bf16BigTiles(ReferenceGemm):
    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        assert weight.weight is not None
        if x.shape[0] >= 512 and weight.out_features >= 1536:
            # the bug: the big-tile path (only the perf tier's 512x576x1536 reaches it) multiplies in bf16
            return (x.bfloat16() @ weight.weight.bfloat16().t()).float()
        return super().linear(x, weight)


class _EpsOutsideSqrt(SmallOps):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        out = xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)  # the bug: eps added after the sqrt
        return (out * weight.to(out.dtype)).to(x.dtype)


class _RotaryAssumesContiguous(SmallOps):
    def rotary(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
        # the bug: the input read with contiguous strides (a raw pointer kernel skipping .contiguous())
        t, h, d = x.shape
        x = torch.as_strided(x, x.shape, (h * d, d, 1), x.storage_offset())
        return super().rotary(x, positions, cos_sin, rotary_dim)


class _WideHeads(_Broken):
    def declare(self) -> Capabilities:
        """Every multiple of 8 up to 256, as a backend with a masked head dimension declares."""
        return Capabilities(**{**_fields(super().declare()), "head_sizes": frozenset(range(16, 257, 8))})


class _Featured(_Broken):
    def declare(self) -> Capabilities:
        """Sliding window and soft-cap on top of the fp32 profile."""
        return Capabilities(
            **{**_fields(super().declare()), "features": frozenset({"sliding_window", "logits_soft_cap"})}
        )


# -- 8: engine models that depend on attention -------------------------------------------------------


class _ZeroAttention(_Dense):
    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float):  # noqa: ANN201
        return torch.zeros_like(query)  # the bug: attention contributes nothing


class _NoCausalMask(_Dense):
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
               cap: float | None) -> torch.Tensor:  # fmt: skip
        return super().attend(q, k, v, torch.ones_like(allowed), scale, cap)  # the bug: every key of the sequence


class _WindowOneShort(_Dense):
    def window_mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
        return q_pos - k_pos < window - 1  # the bug: the oldest key of the window dropped


# -- 9: quantized activation rounding --------------------------------------------------------------


class _TruncatesActivations(_BlockGemm):
    """int8 per 32-block like llama.cpp, but rounded toward zero: inside the worst-case allowance."""

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        xb = x.float().reshape(m, k // 32, 32)
        d = xb.abs().amax(-1, keepdim=True) / 127.0
        q = torch.where(d > 0, xb / d, torch.zeros_like(xb)).trunc()  # the bug: trunc, not round
        return (q * d).reshape(m, k)


class _Int8Per64(_BlockGemm):
    """int8 activations with one scale per 64 values (a block size the format does not use)."""

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        xb = x.float().reshape(m, k // 64, 64)
        d = xb.abs().amax(-1, keepdim=True) / 127.0
        q = torch.where(d > 0, xb / d, torch.zeros_like(xb)).round()
        return (q * d).reshape(m, k)


class _QuantizedBroken(_Broken):
    api_version = (1, 1)

    def declare(self) -> Capabilities:
        return Capabilities(**{**_fields(super().declare()), "quant_formats": frozenset({"q4_1", "q8_0"})})


def _backend(name: str, base: type[_Broken], **attrs: object) -> type[_Broken]:
    return type(name, (base,), {"name": name, **attrs})


class Bf16KVBackend(_Broken):
    """Declares a bf16 KV cache under fp32 compute (no bf16 compute) and truncates on write."""

    name = "broken_bf16_kv_truncates"
    attention_cls = _TruncatesToBf16

    def declare(self) -> Capabilities:
        caps = super().declare()
        return Capabilities(**{**_fields(caps), "kv_cache_dtypes": frozenset({"float32", "bfloat16"})})


class RotaryBackend(_Broken):
    name = "broken_rotary_strides"

    def small_ops(self) -> SmallOps:
        return _RotaryAssumesContiguous()


class RmsEpsBackend(_Broken):
    name = "broken_rms_eps"

    def small_ops(self) -> SmallOps:
        return _EpsOutsideSqrt()


class BigTileGemmBackend(_Broken):
    name = "broken_perf_gemm"
    gemm_cls = _Bf16BigTiles


BACKENDS: list[type[_Broken]] = [
    _backend("broken_gqa_over_8", _Broken, attention_cls=_Tiles8Heads),
    _backend("broken_odd_kv_heads", _Broken, attention_cls=_PairsOfKVHeads),
    _backend("broken_head_tail", _WideHeads, attention_cls=_HeadTail16),
    Bf16KVBackend,
    _backend("broken_split_k", _Broken, attention_cls=_SplitKAverages),
    _backend("broken_gemm_m_tail", _Broken, gemm_cls=_DropsRowTail),
    _backend("broken_copy_blocks", _Broken, attention_cls=_CopiesKeysOnly),
    _backend("broken_nondeterministic", _Broken, attention_cls=_LastBitWobbles),
    BigTileGemmBackend,
    _backend("broken_softmax_no_max", _Broken, attention_cls=_SoftmaxWithoutMax),
    _backend("broken_ignores_scale", _Broken, attention_cls=_RecomputesScale),
    _backend("broken_tanh_overflow", _Featured, attention_cls=_TanhFromExp),
    RmsEpsBackend,
    _backend("broken_window_aligned", _Featured, attention_cls=_AlignedWindowOffByOne),
    _backend("broken_cap_decode", _Featured, attention_cls=_NoCapInDecode),
    _backend("broken_value_strides", _Broken, attention_cls=_ValueUsesKeyStrides),
    RotaryBackend,
    _backend("broken_zero_attention", _Broken, attention_cls=_ZeroAttention),
    _backend("broken_no_causal_mask", _Broken, attention_cls=_NoCausalMask),
    _backend("broken_window_one_short", _Featured, attention_cls=_WindowOneShort),
    _backend("broken_truncates_activations", _QuantizedBroken, gemm_cls=_TruncatesActivations),
    _backend("broken_int8_per_64", _QuantizedBroken, gemm_cls=_Int8Per64),
]
#: entry-point attribute name -> plugin object (``broken_x`` registers as ``x``)
PLUGINS = {cls.name.removeprefix("broken_"): _Plugin(cls) for cls in BACKENDS}
globals().update(PLUGINS)  # entry points name module attributes
