"""Case generation past the mandatory profile: every declared value, and the path switches.

:mod:`.cases` sweeps the declared axes one at a time at small sizes. Real kernels switch code
paths where those sweeps never go, so this module adds, per declaration (extended tier unless
noted):

* **every declared value**: each declared KV-cache dtype with each compute dtype (also KV dtypes
  that are no compute dtype), GQA groups above 8 and odd KV-head counts (3, as SmolLM2), and one
  sweep over *every* declared head size (:class:`HeadSweepCase`);
* **path switches**: contexts of hundreds to thousands of keys, long prompts, a batch of 64
  sequences; GEMMs with M past 256 and not a multiple of any tile, fp16/bf16 with long K;
  quantized products with hundreds of rows and a bias;
* **value regimes**: large scores (softmax without the running maximum overflows), tiny
  operands, a softmax scale that is not 1/sqrt(D), soft-cap logits deep in tanh's saturation,
  RMSNorm inputs with rms far from 1;
* **features crossed with every batch kind** and with window/block alignments (windows of 1, a
  block, two blocks and an unaligned one);
* **operand layouts varied one at a time**: a strided key with a contiguous value and vice
  versa, a strided ``x`` with a column-major weight, rotary on a view into a fused qkv;
* **copy-on-write** (:class:`CopyBlocksCase`, one case in core).

The ``all_*`` functions are what the pytest plugin parametrizes with: the sweeps of
:mod:`.cases` plus these, de-duplicated and limited to what the backend declares.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from plinth.platform.backend import AttentionSpec, Capabilities
from plinth.platform.quant import QUANT_BLOCKS
from plinth_conformance import cases as base
from plinth_conformance.cases import (
    _SHORT,
    KINDS,
    KNOWN_DTYPES,
    MANDATORY_BLOCK_SIZE,
    MANDATORY_DTYPE,
    AttentionCase,
    EngineCase,
    GemmCase,
    KVWriteCase,
    OpsCase,
    QuantCase,
    case_seed,
)
from plinth_conformance.moe_cases import MoECase

#: (query heads per KV head, KV heads) past the one-axis sweep: groups above 8 (kernels that tile
#: 8 heads), odd KV-head counts (SmolLM2: 9 heads over 3), and both at once.
WIDE_GROUPS: tuple[tuple[int, int], ...] = ((3, 3), (1, 3), (7, 3), (9, 2), (12, 2), (16, 1), (6, 5))
#: Sliding windows relative to the block size B: 1 key, exactly one and two blocks, unaligned.
WINDOWS: tuple[str, ...] = ("1", "B", "2B", "B+3")


def _window(spec: str, block: int) -> int:
    return {"1": 1, "B": block, "2B": 2 * block, "B+3": block + 3}[spec]


def _kv_dtypes(caps: Capabilities) -> list[str]:
    """Declared KV-cache dtypes the suite can fill (not only those that are also compute dtypes)."""
    return [d for d in KNOWN_DTYPES if d in caps.kv_cache_dtypes]


def _dtypes(caps: Capabilities) -> list[str]:
    return [d for d in KNOWN_DTYPES if d in caps.dtypes]


@dataclass(frozen=True, slots=True)
class HeadSweepCase:
    """Every declared head size on a small batch (prefill, decode and a chunk after context)."""

    dtype: str
    block_size: int
    head_sizes: tuple[int, ...]
    tier: str = "extended"

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``attn-sweep-f32-bs16-heads``."""
        return f"attn-sweep-{_SHORT[self.dtype]}-bs{self.block_size}-heads"

    @property
    def seed(self) -> int:
        """See :func:`plinth_conformance.cases.case_seed`."""
        return case_seed(self.id)

    @property
    def spec(self) -> AttentionSpec:
        """The spec of the first head size; the sweep replaces ``head_size``."""
        return AttentionSpec(4, 2, self.head_sizes[0], self.block_size, self.dtype, self.dtype)


@dataclass(frozen=True, slots=True)
class CopyBlocksCase:
    """``copy_blocks`` over several layers' caches: forks (one source, two targets) and plain copies."""

    dtype: str
    kv_dtype: str
    head_size: int
    block_size: int
    num_kv_heads: int
    tier: str
    layers: int = 2

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``copyblocks-f32-h64-bs16-kvh2``."""
        kv = _SHORT[self.kv_dtype]
        return f"copyblocks-{_SHORT[self.dtype]}-kv{kv}-h{self.head_size}-bs{self.block_size}-kvh{self.num_kv_heads}"

    @property
    def seed(self) -> int:
        """See :func:`plinth_conformance.cases.case_seed`."""
        return case_seed(self.id)

    @property
    def spec(self) -> AttentionSpec:
        """The attention spec whose cache is copied."""
        return AttentionSpec(
            2 * self.num_kv_heads, self.num_kv_heads, self.head_size, self.block_size, self.dtype, self.kv_dtype
        )


def path_attention_cases(caps: Capabilities, default_dtype: str) -> list[AttentionCase]:
    """The extended attention cases past :func:`plinth_conformance.cases.attention_cases`."""
    ext, f32 = "extended", MANDATORY_DTYPE
    home = base._home_block(caps)
    dtypes = _dtypes(caps)
    cases: list[AttentionCase] = []
    for dtype in dtypes:  # every declared KV dtype under every compute dtype (the cast paths)
        for kv in _kv_dtypes(caps):
            if kv != dtype:
                cases += [AttentionCase(dtype, kv, 64, home, 2, 2, k, ext) for k in ("mixed", "decode")]
    for group, hkv in WIDE_GROUPS + ((caps.max_gqa_ratio or 8, 1),):
        cases += [AttentionCase(f32, f32, 64, home, hkv, group, k, ext) for k in ("decode", "mixed")]
    for dtype in dtypes:  # long contexts, long prompts, 64 sequences; and the value regimes
        cases += [AttentionCase(dtype, dtype, 128, home, 2, 4, k, ext) for k in base.LONG_KINDS]
        cases += [AttentionCase(dtype, dtype, 64, home, 2, 4, k, ext, regime="large") for k in ("mixed", "decode")]
        cases += [AttentionCase(dtype, dtype, 64, home, 2, 2, "mixed", ext, regime="small")]
        cases += [AttentionCase(dtype, dtype, 64, home, 2, 2, k, ext, regime="scale") for k in ("prefill", "decode")]
    blocks = base._block_sizes(caps)
    for block in {blocks[0], blocks[-1]} if blocks else set():  # the long paths at the extreme block sizes
        cases.append(AttentionCase(f32, f32, 128, block, 2, 4, "long-decode", ext))
    if "sliding_window" in caps.features:  # every batch kind x window/block alignment
        for w in WINDOWS:
            window = _window(w, home)
            cases += [AttentionCase(f32, f32, 64, home, 2, 2, k, ext, sliding_window=window) for k in KINDS[:4]]
        cases += [AttentionCase(f32, f32, 128, home, 2, 4, k, ext, sliding_window=300) for k in base.LONG_KINDS[:2]]
    if "logits_soft_cap" in caps.features:
        cases += [AttentionCase(f32, f32, 64, home, 2, 2, k, ext, soft_cap=2.0) for k in KINDS]
        cases += [
            AttentionCase(f32, f32, 64, home, 2, 2, k, ext, soft_cap=5.0, regime="adversarial")
            for k in ("prefill", "decode", "mixed", "chunked")
        ]
        cases.append(AttentionCase(f32, f32, 128, home, 2, 4, "long-decode", ext, soft_cap=30.0))
    if {"sliding_window", "logits_soft_cap"} <= caps.features:
        cases += [
            AttentionCase(f32, f32, 64, home, 2, 2, k, ext, sliding_window=home, soft_cap=5.0, regime="adversarial")
            for k in ("decode", "chunked")
        ]
    return cases


def all_attention_cases(caps: Capabilities, default_dtype: str) -> list[AttentionCase]:
    """Every attention case the plugin runs (core and extended)."""
    return base._dedupe(base.attention_cases(caps, default_dtype) + path_attention_cases(caps, default_dtype), caps)


def head_sweep_cases(caps: Capabilities, default_dtype: str) -> list[HeadSweepCase]:
    """One sweep over every declared head size, in float32 and in the default dtype."""
    heads = tuple(sorted(caps.head_sizes))
    if not heads or not caps.block_sizes:
        return []
    home = base._home_block(caps)
    dtypes = [d for d in _dtypes(caps) if d in (MANDATORY_DTYPE, default_dtype) and d in caps.kv_cache_dtypes]
    return [HeadSweepCase(d, home, heads) for d in dtypes]


def all_kv_write_cases(caps: Capabilities, default_dtype: str = MANDATORY_DTYPE) -> list[KVWriteCase]:
    """:func:`plinth_conformance.cases.kv_write_cases`, every declared KV dtype under every compute
    dtype, a 3- and a 5-KV-head cache, and each operand strided on its own."""
    home, ext = base._home_block(caps), "extended"
    cases = base.kv_write_cases(caps, default_dtype)
    for dtype in _dtypes(caps):
        cases += [KVWriteCase(dtype, kv, 64, home, 2, ext, layout="strided") for kv in _kv_dtypes(caps)]
    cases += [
        KVWriteCase(MANDATORY_DTYPE, MANDATORY_DTYPE, 128, home, 3, ext, layout=lay)
        for lay in ("k-strided", "v-strided")
    ]
    cases.append(KVWriteCase(MANDATORY_DTYPE, MANDATORY_DTYPE, 64, home, 5, ext, layout="v-strided"))
    return base._dedupe(cases, caps)


def copy_blocks_cases(caps: Capabilities, default_dtype: str = MANDATORY_DTYPE) -> list[CopyBlocksCase]:
    """Core: the mandatory profile; extended: every declared KV dtype and block size, 3 KV heads."""
    f32, home = MANDATORY_DTYPE, base._home_block(caps)
    cases = [CopyBlocksCase(f32, f32, 64, MANDATORY_BLOCK_SIZE, 2, "core")]
    cases += [
        CopyBlocksCase(f32 if f32 in caps.dtypes else kv, kv, 128, home, 3, "extended") for kv in _kv_dtypes(caps)
    ]
    cases += [CopyBlocksCase(f32, f32, 64, b, 2, "extended") for b in base._block_sizes(caps)]
    return base._dedupe(cases, caps)


def all_gemm_cases(caps: Capabilities, default_dtype: str) -> list[GemmCase]:
    """:func:`plinth_conformance.cases.gemm_cases` plus M past 256 and off every tile, long K in
    each dtype, and a strided ``x`` with a column-major weight."""
    ext, f32 = "extended", MANDATORY_DTYPE
    cases = base.gemm_cases(caps, default_dtype)
    if f32 in caps.dtypes:
        cases += [
            GemmCase(f32, 257, 576, 576, False, "contiguous", ext),
            GemmCase(f32, 300, 1536, 576, True, "contiguous", ext),
            GemmCase(f32, 1000, 576, 197, True, "contiguous", ext),
        ]
    for dtype in _dtypes(caps):
        cases.append(GemmCase(dtype, 300, 576, 577, True, "contiguous", ext))
        cases.append(GemmCase(dtype, 17, 4096, 256, True, "contiguous", ext))  # long K
        cases.append(GemmCase(dtype, 33, 255, 513, True, "x-strided+w-transposed", ext))
    return base._dedupe(cases)


def all_quant_cases(caps: Capabilities, default_dtype: str) -> list[QuantCase]:
    """:func:`plinth_conformance.cases.quant_cases` plus products with hundreds of rows and a bias."""
    cases = base.quant_cases(caps, default_dtype)
    for fmt in sorted(caps.quant_formats):
        if fmt in QUANT_BLOCKS:
            cases.append(QuantCase(fmt, MANDATORY_DTYPE, 300, 576, 197, True, "contiguous", "extended"))
            cases.append(QuantCase(fmt, MANDATORY_DTYPE, 129, 1536, 77, True, "x-strided", "extended"))
    return base._dedupe(cases)


def all_ops_cases(caps: Capabilities, default_dtype: str = MANDATORY_DTYPE) -> list[OpsCase]:
    """:func:`plinth_conformance.cases.ops_cases` plus RMSNorm far from rms 1 and strided inputs."""
    cases = base.ops_cases(caps, default_dtype)
    for dtype in _dtypes(caps) or [MANDATORY_DTYPE]:
        for op in ("rms_norm", "add_rms_norm"):
            cases += [OpsCase(op, dtype, "extended", magnitude=m) for m in (1e-3, 1e3)]
        strided = ("rms_norm", "silu_and_mul", "rotary", "rms_norm_heads", "gelu_tanh_and_mul")
        cases += [OpsCase(op, dtype, "extended", layout="strided") for op in strided]
        cases.append(OpsCase("rotary", dtype, "extended", rotary_dim=32, layout="strided"))
    return base._dedupe(cases)


# -- what a run covered (for the certificate) ----------------------------------------------------------


def covered(cases: list[Any], caps: Capabilities | None) -> dict[str, Any]:
    """The capability values and path classes the passed ``cases`` exercised, and the declared
    values none of them did (a reader sees what "passed" covers)."""
    attn = [c for c in cases if isinstance(c, AttentionCase)]
    sweeps = [c for c in cases if isinstance(c, HeadSweepCase)]
    values: dict[str, set[Any]] = defaultdict(set)
    for c in attn:
        values["dtypes"].add(c.dtype)
        values["kv_cache_dtypes"].add(c.kv_dtype)
        values["dtype_pairs"].add(f"{c.dtype}/{c.kv_dtype}")
        values["head_sizes"].add(c.head_size)
        values["block_sizes"].add(c.block_size)
        values["gqa_groups"].add(c.group)
        values["kv_heads"].add(c.num_kv_heads)
        values["batch_kinds"].add(c.kind)
        values["value_regimes"].add(c.regime)
        if c.sliding_window:
            values["sliding_windows"].add(c.sliding_window)
        if c.soft_cap:
            values["soft_caps"].add(c.soft_cap)
    for s in sweeps:
        values["head_sizes"].update(s.head_sizes)
        values["dtypes"].add(s.dtype)
    paths: dict[str, int] = defaultdict(int)
    for c in cases:
        for tag in path_tags(c):
            paths[tag] += 1
    out: dict[str, Any] = {k: sorted(v) for k, v in sorted(values.items())}  # each set holds one type
    out["gemm_shapes"] = sorted({f"{c.m}x{c.k}x{c.n}" for c in cases if isinstance(c, GemmCase)})
    out["quant_shapes"] = sorted({f"{c.fmt}:{c.m}x{c.k}x{c.n}" for c in cases if isinstance(c, QuantCase) and c.m})
    out["moe_shapes"] = sorted(
        {f"e{c.experts}k{c.top_k}:{c.dtype}:{c.quant or 'dense'}" for c in cases if isinstance(c, MoECase) and c.tokens}
    )
    out["path_classes"] = dict(sorted(paths.items()))
    if caps is not None:
        declared: dict[str, set[Any]] = {
            "dtypes": set(_dtypes(caps)),
            "kv_cache_dtypes": set(_kv_dtypes(caps)),
            "head_sizes": set(caps.head_sizes),
            "block_sizes": set(caps.block_sizes),
        }
        out["declared_not_exercised"] = {k: sorted(v - values[k]) for k, v in declared.items() if v - values[k]}
    return out


def path_tags(case: Any) -> list[str]:
    """The path classes a case belongs to (what the certificate counts)."""
    tags: list[str] = []
    if isinstance(case, AttentionCase):
        tags.append(f"attention-{case.kind}")
        if case.kv_dtype != case.dtype:
            tags.append("attention-kv-dtype-cast")
        if case.group > 8:
            tags.append("gqa-group>8")
        if case.num_kv_heads % 2 == 1 and case.num_kv_heads > 1:
            tags.append("odd-kv-heads")
        if case.regime != "normal":
            tags.append(f"values-{case.regime}")
        if case.sliding_window:
            aligned = case.sliding_window % case.block_size == 0
            tags.append("window-block-aligned" if aligned else "window-unaligned")
        if case.soft_cap:
            tags.append("soft-cap")
        if case.twice:
            tags.append("determinism")
    elif isinstance(case, HeadSweepCase):
        tags.append("head-size-sweep")
    elif isinstance(case, CopyBlocksCase):
        tags.append("copy-blocks")
    elif isinstance(case, GemmCase):
        tags.append("gemm-m>256-untiled" if case.m > 256 and case.m % 64 else "gemm")
        if case.k >= 4096:
            tags.append("gemm-long-k")
        if "+" in case.layout:
            tags.append("gemm-mixed-layouts")
        if case.twice:
            tags.append("determinism")
    elif isinstance(case, QuantCase) and case.skip is None:
        tags.append("quant-many-rows" if case.m >= 128 else "quant")
        if case.twice:
            tags.append("determinism")
    elif isinstance(case, MoECase) and case.skip is None:
        tags.append(f"moe-{case.routing}" if case.quant is None else "moe-quantized")
        if case.tokens >= 2048:
            tags.append("moe-t2048")
        if case.guarded:
            tags.append("moe-guarded")
        if case.twice:
            tags.append("determinism")
    elif isinstance(case, KVWriteCase):
        tags.append(f"kv-write-{case.layout}")
    elif isinstance(case, EngineCase):
        tags.append("engine-context-dependent" if case.model.startswith("induction") else "engine-random-model")
        if case.check == "forks-and-prefix-hits":
            tags += ["engine-forks-copy-blocks", "engine-prefix-cache-hit"]
        if case.model.endswith("-sw"):
            tags.append("engine-sliding-window")
    elif isinstance(case, OpsCase):
        tags.append(
            f"ops-{case.op}"
            + ("" if case.magnitude == 1.0 else "-far-from-1")
            + ("-strided" if case.layout != "contiguous" else "")
        )
        tags.append("determinism")
    return tags
