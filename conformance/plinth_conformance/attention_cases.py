"""Attention and KV-cache write cases: one paged-attention call or one KV write per case, for the
mandatory profile (core) and every declared axis swept one at a time (extended)."""

from __future__ import annotations

from dataclasses import dataclass

from plinth.platform.backend import AttentionSpec, Capabilities
from plinth_conformance.case_base import (
    _SHORT,
    GROUP_SIZES,
    KINDS,
    KNOWN_DTYPES,
    LONG_KINDS,
    MANDATORY_BLOCK_SIZE,
    MANDATORY_DTYPE,
    MANDATORY_GQA_RATIO,
    MANDATORY_HEAD_SIZES,
    MODEL_HEAD_SIZES,
    _block_sizes,
    _dedupe,
    _dtypes,
    _group_ok,
    _home_block,
    case_seed,
)


@dataclass(frozen=True, slots=True)
class AttentionCase:
    """One paged-attention call: a batch ``kind`` for one attention spec."""

    dtype: str
    kv_dtype: str
    head_size: int
    block_size: int
    num_kv_heads: int
    group: int  # query heads per KV head
    kind: str
    tier: str
    sliding_window: int | None = None
    soft_cap: float | None = None
    regime: str = "normal"  # value regime, see plinth_conformance.paged.REGIMES

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``attn-f32-h128-bs16-g4x2-mixed``."""
        kv = "" if self.kv_dtype == self.dtype else f"-kv{_SHORT[self.kv_dtype]}"
        extra = (
            (f"-sw{self.sliding_window}" if self.sliding_window else "")
            + (f"-cap{self.soft_cap:g}" if self.soft_cap else "")
            + ("" if self.regime == "normal" else f"-v{self.regime}")
        )
        return (
            f"attn-{_SHORT[self.dtype]}{kv}-h{self.head_size}-bs{self.block_size}"
            f"-g{self.group}x{self.num_kv_heads}-{self.kind}{extra}"
        )

    @property
    def seed(self) -> int:
        """See :func:`case_seed`."""
        return case_seed(self.id)

    @property
    def twice(self) -> bool:
        """Run ``forward`` twice and require bit-identical outputs: the long and big-batch paths
        (where split-K and threaded reductions live) and a few core cases."""
        core = self.tier == "core" and (self.kind == "decode" or (self.kind == "mixed" and self.group == 4))
        return self.kind in LONG_KINDS or core

    @property
    def spec(self) -> AttentionSpec:
        """The attention spec this case asks the backend for."""
        return AttentionSpec(
            num_heads=self.num_kv_heads * self.group,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            block_size=self.block_size,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_dtype,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.soft_cap,
        )


@dataclass(frozen=True, slots=True)
class KVWriteCase:
    """One KV-cache write: ``num_tokens`` tokens (some padding) into a NaN-filled cache."""

    dtype: str
    kv_dtype: str
    head_size: int
    block_size: int
    num_kv_heads: int
    tier: str
    # "contiguous"; "strided": key and value are views into a fused qkv projection; "k-strided" /
    # "v-strided": only that one is (real models pass a contiguous key with a strided value)
    layout: str = "contiguous"

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``kvwrite-f32-h64-bs16``."""
        kv = "" if self.kv_dtype == self.dtype else f"-kv{_SHORT[self.kv_dtype]}"
        suffix = {"contiguous": "", "strided": "-strided", "k-strided": "-kstrided", "v-strided": "-vstrided"}
        return (
            f"kvwrite-{_SHORT[self.dtype]}{kv}-h{self.head_size}-bs{self.block_size}-kvh{self.num_kv_heads}"
            + suffix[self.layout]
        )

    @property
    def seed(self) -> int:
        """See :func:`case_seed`."""
        return case_seed(self.id)

    @property
    def spec(self) -> AttentionSpec:
        """The attention spec this case asks the backend for."""
        return AttentionSpec(
            2 * self.num_kv_heads, self.num_kv_heads, self.head_size, self.block_size, self.dtype, self.kv_dtype
        )


# -- generation ---------------------------------------------------------------------------------------


def attention_cases(caps: Capabilities, default_dtype: str) -> list[AttentionCase]:
    """Core: the mandatory profile (and the default dtype); extended: everything declared, by axis."""
    f32 = MANDATORY_DTYPE
    bs16 = MANDATORY_BLOCK_SIZE
    cases = [
        AttentionCase(f32, f32, h, bs16, 2, g, "mixed", "core")
        for h in MANDATORY_HEAD_SIZES
        for g in (1, 2, 4, MANDATORY_GQA_RATIO)
    ]
    cases += [
        AttentionCase(f32, f32, h, bs16, 2, 2, kind, "core")
        for h in MANDATORY_HEAD_SIZES
        for kind in ("prefill", "decode", "chunked", "shared")
    ]
    home = _home_block(caps)
    if default_dtype != f32 and default_dtype in KNOWN_DTYPES:
        cases.append(AttentionCase(default_dtype, default_dtype, 64, home, 2, 2, "mixed", "core"))
    ext = "extended"
    heads = [h for h in MODEL_HEAD_SIZES if h in caps.head_sizes]
    for dtype in _dtypes(caps):
        cases += [AttentionCase(dtype, dtype, h, home, 2, 4 if _group_ok(caps, 4) else 1, "mixed", ext) for h in heads]
        cases += [AttentionCase(dtype, dtype, 64, home, 2, 1, kind, ext) for kind in ("decode", "chunked", "shared")]
    for kv_dtype in _dtypes(caps):
        if kv_dtype in caps.kv_cache_dtypes and kv_dtype != f32 and f32 in caps.dtypes:
            cases.append(AttentionCase(f32, kv_dtype, 64, home, 2, 2, "mixed", ext))
    for block in _block_sizes(caps):
        cases += [AttentionCase(f32, f32, 64, block, 2, 2, kind, ext) for kind in ("mixed", "chunked", "shared")]
    for group in GROUP_SIZES:
        if _group_ok(caps, group):
            cases += [AttentionCase(f32, f32, 128, home, 2, group, kind, ext) for kind in ("decode", "chunked")]
    if _group_ok(caps, 8):
        cases.append(AttentionCase(f32, f32, 64, home, 1, 8, "mixed", ext))  # MQA: one KV head
    window = home + 3  # cuts through the middle of the longer sequences
    if "sliding_window" in caps.features:
        cases += [AttentionCase(f32, f32, 64, home, 2, 2, k, ext, sliding_window=window) for k in KINDS]
    if "logits_soft_cap" in caps.features:
        cases += [AttentionCase(f32, f32, 64, home, 2, 2, k, ext, soft_cap=2.0) for k in ("mixed", "chunked")]
    if {"sliding_window", "logits_soft_cap"} <= caps.features:
        cases.append(AttentionCase(f32, f32, 128, home, 2, 4, "mixed", ext, sliding_window=window, soft_cap=2.0))
    return _dedupe(cases, caps)


def kv_write_cases(caps: Capabilities, default_dtype: str = MANDATORY_DTYPE) -> list[KVWriteCase]:
    """Core: the mandatory profile (plain and strided inputs); extended: declared dtypes, blocks, heads."""
    f32, bs16 = MANDATORY_DTYPE, MANDATORY_BLOCK_SIZE
    cases = [KVWriteCase(f32, f32, h, bs16, 2, "core") for h in MANDATORY_HEAD_SIZES]
    cases.append(KVWriteCase(f32, f32, 128, bs16, 2, "core", layout="strided"))
    home = _home_block(caps)
    for dtype in _dtypes(caps):
        for kv_dtype in _dtypes(caps):
            if kv_dtype in caps.kv_cache_dtypes and (kv_dtype == dtype or dtype == f32):
                cases.append(KVWriteCase(dtype, kv_dtype, 64, home, 2, "extended", layout="strided"))
    cases += [KVWriteCase(f32, f32, 64, b, 3, "extended") for b in _block_sizes(caps)]
    cases += [KVWriteCase(f32, f32, h, home, 1, "extended") for h in MODEL_HEAD_SIZES if h in caps.head_sizes]
    return _dedupe(cases, caps)
