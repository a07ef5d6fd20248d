"""The cases the suite runs, generated from a backend's declared capabilities.

Every case has an id (its pytest parameter id) and a seed derived from the suite version and that
id, so a failing case is reproduced exactly by running it alone. The mandatory core profile is
generated whatever the backend declares: declaring nothing cannot pass.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

from plinth.platform.backend import AttentionSpec, Capabilities
from plinth.platform.quant import QUANT_BLOCKS
from plinth_conformance import SUITE_VERSION

#: What every backend must declare and pass (the core tier).
MANDATORY_DTYPE = "float32"
MANDATORY_HEAD_SIZES: tuple[int, ...] = (64, 128)
MANDATORY_BLOCK_SIZE = 16
MANDATORY_GQA_RATIO = 8
#: Head sizes real models use; extended runs those the backend declares.
MODEL_HEAD_SIZES: tuple[int, ...] = (64, 80, 96, 128, 256)
#: Query heads per KV head exercised in extended (5: a ratio that is no power of two).
GROUP_SIZES: tuple[int, ...] = (1, 2, 4, 5, 8)
#: Block sizes above this are not exercised (their "long" sequences get too slow for CI).
MAX_TESTED_BLOCK_SIZE = 256
#: Dtypes the suite knows how to generate and compare.
KNOWN_DTYPES: tuple[str, ...] = ("float32", "float64", "bfloat16", "float16")
#: Batch shapes of one attention call (see :func:`plinth_conformance.paged.batch_lengths`).
KINDS: tuple[str, ...] = ("prefill", "decode", "mixed", "chunked", "shared")
#: Batch shapes past the sizes where kernels switch paths (extended tier).
LONG_KINDS: tuple[str, ...] = ("long-decode", "long-prefill", "big-batch")

_SHORT = {"float32": "f32", "float64": "f64", "bfloat16": "bf16", "float16": "f16"}


def case_seed(case_id: str) -> int:
    """The seed of a case: a hash of the suite version and the case id (stable across runs/hosts)."""
    digest = hashlib.sha256(f"plinth-conformance {SUITE_VERSION} {case_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


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


@dataclass(frozen=True, slots=True)
class GemmCase:
    """``x [M, K] @ w.T [K, N] (+ b)``, with a memory layout variant of the operands."""

    dtype: str
    m: int
    k: int
    n: int
    bias: bool
    # "contiguous", "x-transposed", "x-strided" (guarded view), "w-transposed", or two joined by "+"
    layout: str
    tier: str

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``gemm-f32-33x255x513-bias-x-strided``."""
        return (
            f"gemm-{_SHORT[self.dtype]}-{self.m}x{self.k}x{self.n}"
            + ("-bias" if self.bias else "")
            + ("" if self.layout == "contiguous" else f"-{self.layout}")
        )

    @property
    def seed(self) -> int:
        """See :func:`case_seed`."""
        return case_seed(self.id)

    @property
    def twice(self) -> bool:
        """Run ``linear`` twice (bit-identical): the core tier's unaligned case and every M >= 256."""
        return self.m >= 256 or (self.tier == "core" and self.k == 255 and self.layout == "contiguous")


@dataclass(frozen=True, slots=True)
class QuantCase:
    """``x [M, K] @ dequantize(w).T (+ b)`` with ``w`` a ggml block-format weight (API 1.1).

    ``skip`` is set for the placeholder case of a backend that declares no format (or one
    :mod:`plinth.platform.quant` does not define): it says why nothing quantized was checked.
    """

    fmt: str
    dtype: str
    m: int
    k: int
    n: int
    bias: bool
    layout: str  # "contiguous" or "x-strided" (x a view into a NaN-guarded buffer)
    tier: str
    skip: str | None = None

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``quant-q4_1-f32-17x576x197-bias``; ``quant-none-declared`` for the placeholder."""
        if self.skip is not None:
            return f"quant-{self.fmt}"
        return (
            f"quant-{self.fmt}-{_SHORT[self.dtype]}-{self.m}x{self.k}x{self.n}"
            + ("-bias" if self.bias else "")
            + ("" if self.layout == "contiguous" else f"-{self.layout}")
        )

    @property
    def seed(self) -> int:
        """See :func:`case_seed`."""
        return case_seed(self.id)

    @property
    def twice(self) -> bool:
        """Run ``linear`` twice (bit-identical): the core decode case and every M >= 17."""
        return self.m >= 17 or self.tier == "core"


@dataclass(frozen=True, slots=True)
class OpsCase:
    """One SmallOps call (``rms_norm``, ``add_rms_norm``, ``silu_and_mul``, ``rotary``) in one dtype."""

    op: str
    dtype: str
    tier: str
    rotary_dim: int = 64
    layout: str = "contiguous"  # "strided": the input is a view into a fused qkv / wider buffer
    magnitude: float = 1.0  # inputs scaled by this (RMSNorm far from rms 1: where eps shows)

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``ops-rotary-f32-rd32``."""
        return (
            f"ops-{self.op}-{_SHORT[self.dtype]}"
            + (f"-rd{self.rotary_dim}" if self.op == "rotary" else "")
            + ("" if self.layout == "contiguous" else f"-{self.layout}")
            + ("" if self.magnitude == 1.0 else f"-x{self.magnitude:g}")
        )

    @property
    def seed(self) -> int:
        """See :func:`case_seed`."""
        return case_seed(self.id)


# -- generation ---------------------------------------------------------------------------------------


def _dtypes(caps: Capabilities) -> list[str]:
    """Declared dtypes the suite can test, float32 first."""
    return [d for d in KNOWN_DTYPES if d in caps.dtypes]


def _block_sizes(caps: Capabilities) -> list[int]:
    return [b for b in caps.block_sizes if b <= MAX_TESTED_BLOCK_SIZE]


def _home_block(caps: Capabilities) -> int:
    """The block size the head-size / dtype sweeps use: 16 when declared."""
    blocks = _block_sizes(caps)
    return MANDATORY_BLOCK_SIZE if MANDATORY_BLOCK_SIZE in blocks or not blocks else blocks[0]


def _group_ok(caps: Capabilities, group: int) -> bool:
    return caps.max_gqa_ratio is None or group <= caps.max_gqa_ratio


def _dedupe(cases: list, caps: Capabilities | None = None) -> list:
    """Drop repeated ids, and extended cases ``caps`` does not declare (core ones are mandatory)."""
    seen: dict[str, Any] = {}
    for case in cases:
        if caps is not None and case.tier != "core" and caps.unsupported(case.spec):
            continue
        seen.setdefault(case.id, case)
    return list(seen.values())


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


#: SmolLM2-135M's GEMM shapes (K, N): q/o 576x576, k/v 576x192, gate/up 576x1536, down 1536x576.
SMOLLM2_SHAPES: tuple[tuple[int, int], ...] = ((576, 576), (576, 192), (576, 1536), (1536, 576))
SMOLLM2_VOCAB = 49152


def gemm_cases(caps: Capabilities, default_dtype: str) -> list[GemmCase]:
    """Core: unaligned and real-model shapes in fp32 with every operand layout; extended: M sweep,
    the vocabulary projection and every declared dtype."""
    f32 = MANDATORY_DTYPE
    cases = [
        GemmCase(f32, 33, 255, 513, True, layout, "core")
        for layout in ("contiguous", "x-transposed", "x-strided", "w-transposed")
    ]
    cases += [
        GemmCase(f32, m, k, n, m % 2 == 1, "contiguous", "core")
        for m, (k, n) in zip((1, 16, 7, 64), SMOLLM2_SHAPES, strict=True)
    ]
    if default_dtype != f32 and default_dtype in KNOWN_DTYPES:
        cases.append(GemmCase(default_dtype, 33, 255, 513, True, "x-strided", "core"))
    ext = "extended"
    for dtype in _dtypes(caps):
        cases += [GemmCase(dtype, m, 576, 1536, False, "contiguous", ext) for m in (1, 17, 256)]
        cases += [GemmCase(dtype, 33, 255, 513, True, layout, ext) for layout in ("x-strided", "w-transposed")]
        cases.append(GemmCase(dtype, 2, 1536, 576, True, "x-transposed", ext))
    if f32 in caps.dtypes:
        cases.append(GemmCase(f32, 2048, 576, 576, False, "contiguous", ext))
        cases.append(GemmCase(f32, 5, 576, SMOLLM2_VOCAB, False, "contiguous", ext))
    return _dedupe(cases)


#: The SmallOps the suite checks (``add_rms_norm`` since plugin API 1.1).
SMALL_OPS: tuple[str, ...] = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary")


def ops_cases(caps: Capabilities, default_dtype: str = MANDATORY_DTYPE) -> list[OpsCase]:
    """Core: fp32; extended: every declared dtype. Rotary with full and partial rotary dims."""
    cases: list[OpsCase] = []
    for dtype in _dtypes(caps) or [MANDATORY_DTYPE]:
        tier = "core" if dtype == MANDATORY_DTYPE else "extended"
        cases += [OpsCase(op, dtype, tier) for op in SMALL_OPS]
        cases.append(OpsCase("rotary", dtype, tier, rotary_dim=32))
    if MANDATORY_DTYPE not in caps.dtypes:
        cases += [OpsCase(op, MANDATORY_DTYPE, "core") for op in SMALL_OPS]
    return _dedupe(cases)


#: Quantized GEMM shapes (M, K, N, bias, layout): M 1 (decode), a few, and past 16 rows; K a
#: multiple of 32 (SmolLM2's 576 and 1536, and 256); N never a multiple of 8; N = 2051 spans
#: more than 2048 weight rows (where kernels that tile N start a second tile).
QUANT_SHAPES: tuple[tuple[int, int, int, bool, str], ...] = (
    (1, 256, 77, False, "contiguous"),
    (3, 1536, 77, True, "contiguous"),
    (5, 576, 197, False, "contiguous"),
    (5, 256, 77, True, "x-strided"),
    (17, 576, 197, True, "contiguous"),
    (33, 256, 77, False, "contiguous"),
    (33, 576, 2051, True, "contiguous"),
)


def quant_cases(caps: Capabilities, default_dtype: str) -> list[QuantCase]:
    """Per declared block format: core one decode case in fp32 (and one in the default dtype; the
    engine multiplies declared formats natively by default); extended the shape sweep in fp32 and
    one case per other declared dtype. No declared format: one skipped placeholder saying so."""
    f32 = MANDATORY_DTYPE
    formats = sorted(caps.quant_formats)
    if not formats:
        why = "no quantized GEMM format declared (Capabilities.quant_formats is empty)"
        return [QuantCase("none-declared", f32, 0, 0, 0, False, "contiguous", "extended", skip=why)]
    cases: list[QuantCase] = []
    for fmt in formats:
        if fmt not in QUANT_BLOCKS:
            why = (
                f"declared format {fmt!r} is not one plinth.platform.quant defines "
                f"({', '.join(sorted(QUANT_BLOCKS))}): "
                "the core never hands such weights to the backend"
            )
            cases.append(QuantCase(f"{fmt}-unknown", f32, 0, 0, 0, False, "contiguous", "extended", skip=why))
            continue
        cases.append(QuantCase(fmt, f32, 1, 576, 197, True, "contiguous", "core"))
        if default_dtype != f32 and default_dtype in KNOWN_DTYPES:
            cases.append(QuantCase(fmt, default_dtype, 5, 576, 197, True, "contiguous", "core"))
        cases += [QuantCase(fmt, f32, m, k, n, b, layout, "extended") for m, k, n, b, layout in QUANT_SHAPES]
        others = [d for d in _dtypes(caps) if d != f32]
        cases += [QuantCase(fmt, dtype, 5, 576, 197, True, "contiguous", "extended") for dtype in others]
    return _dedupe(cases)


@dataclass(frozen=True, slots=True)
class UndeclaredCase:
    """A case the backend does not declare: it must raise ``NotSupported``, not return numbers."""

    what: str  # the dimension that is out of the declared set
    spec: AttentionSpec | None  # an attention spec to ask for, or None for a GEMM dtype
    gemm_dtype: str | None = None
    tier: str = "core"

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``undeclared-head-size-80``."""
        return f"undeclared-{self.what}"

    @property
    def seed(self) -> int:
        """See :func:`case_seed`."""
        return case_seed(self.id)


def _first_missing(candidates: tuple[Any, ...], declared: Any) -> Any:
    return next((c for c in candidates if c not in declared), None)


def undeclared_cases(caps: Capabilities, default_dtype: str) -> list[UndeclaredCase]:
    """One case per dimension that has an undeclared value: head size, block size, dtypes, GQA
    ratio, sliding window, soft-cap, GEMM dtype."""
    dtype = MANDATORY_DTYPE if MANDATORY_DTYPE in caps.dtypes else next(iter(sorted(caps.dtypes)), MANDATORY_DTYPE)
    kv = dtype if dtype in caps.kv_cache_dtypes else next(iter(sorted(caps.kv_cache_dtypes)), dtype)
    head = next((h for h in (*MANDATORY_HEAD_SIZES, *sorted(caps.head_sizes)) if h in caps.head_sizes), 64)
    block = _home_block(caps) if caps.block_sizes else MANDATORY_BLOCK_SIZE
    base = AttentionSpec(4, 2, head, block, dtype, kv)
    cases: list[UndeclaredCase] = []
    if (h := _first_missing((80, 96, 72, 100, 36, 513, 1024, 4096), caps.head_sizes)) is not None:
        cases.append(UndeclaredCase(f"head-size-{h}", replace(base, head_size=h)))
    if (b := _first_missing((3, 5, 24, 48, 512, 1024), caps.block_sizes)) is not None:
        cases.append(UndeclaredCase(f"block-size-{b}", replace(base, block_size=b)))
    if (d := _first_missing(KNOWN_DTYPES, caps.dtypes)) is not None:
        cases.append(UndeclaredCase(f"dtype-{_SHORT[d]}", replace(base, dtype=d, kv_cache_dtype=d)))
        cases.append(UndeclaredCase(f"gemm-dtype-{_SHORT[d]}", None, gemm_dtype=d))
    if (d := _first_missing(KNOWN_DTYPES, caps.kv_cache_dtypes)) is not None:
        cases.append(UndeclaredCase(f"kv-cache-dtype-{_SHORT[d]}", replace(base, kv_cache_dtype=d)))
    if caps.max_gqa_ratio is not None:
        ratio = caps.max_gqa_ratio + 1
        cases.append(UndeclaredCase(f"gqa-ratio-{ratio}", replace(base, num_heads=ratio, num_kv_heads=1)))
    if "sliding_window" not in caps.features:
        cases.append(UndeclaredCase("sliding-window", replace(base, sliding_window=8)))
    if "logits_soft_cap" not in caps.features:
        cases.append(UndeclaredCase("logits-soft-cap", replace(base, logits_soft_cap=30.0)))
    return cases


@dataclass(frozen=True, slots=True)
class EngineCase:
    """Whole-engine greedy decoding on a tiny random model (see :mod:`.tiny_models`)."""

    model: str  # "llama" (GQA, tied embeddings), "qwen2" (qkv bias), "mistral-sw" (sliding window)
    check: str  # "greedy-vs-reference" or "batch-invariance"
    block_size: int
    tier: str = "extended"

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``engine-llama-greedy-vs-reference``."""
        return f"engine-{self.model}-{self.check}"

    @property
    def seed(self) -> int:
        """See :func:`case_seed`."""
        return case_seed(self.id)


def engine_cases(caps: Capabilities, default_dtype: str) -> list[EngineCase]:
    """Greedy equality with the reference and batch invariance, per tiny model the backend can run."""
    block = _home_block(caps)
    models = ["llama", "qwen2"] + (["mistral-sw"] if "sliding_window" in caps.features else [])
    return [EngineCase(m, c, block) for m in models for c in ("greedy-vs-reference", "batch-invariance")]


@dataclass(frozen=True, slots=True)
class PerfCase:
    """One timed kernel, normalised to the machine's roofline (see :mod:`.perf`)."""

    name: str
    tier: str = "perf"

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``perf-decode-attention``."""
        return f"perf-{self.name}"

    @property
    def seed(self) -> int:
        """See :func:`case_seed`."""
        return case_seed(self.id)


def perf_cases(caps: Capabilities, default_dtype: str) -> list[PerfCase]:
    """Decode attention (bandwidth-bound), prefill attention and GEMMs at batch 1 and 512."""
    return [PerfCase(n) for n in ("decode-attention", "prefill-attention", "gemm-m1", "gemm-m512", "kv-write")]
