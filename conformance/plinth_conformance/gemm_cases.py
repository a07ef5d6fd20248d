"""GEMM, quantized GEMM and SmallOps cases: real-model and unaligned shapes, operand layouts, and
every declared dtype and block format."""

from __future__ import annotations

from dataclasses import dataclass

from plinth.platform.backend import Capabilities
from plinth.platform.quant import QUANT_BLOCKS
from plinth_conformance.case_base import _SHORT, KNOWN_DTYPES, MANDATORY_DTYPE, _dedupe, _dtypes, case_seed


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
    """One SmallOps call (``rms_norm``, ``add_rms_norm``, ``silu_and_mul``, ``rotary``, ``rms_norm_heads``,
    ``gelu_tanh_and_mul``) in one dtype."""

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


#: The SmallOps the suite checks (``add_rms_norm`` since plugin API 1.1; ``rms_norm_heads`` and
#: ``gelu_tanh_and_mul``, plugin API 1.8, since suite 1.6).
SMALL_OPS: tuple[str, ...] = (
    "rms_norm",
    "add_rms_norm",
    "silu_and_mul",
    "rotary",
    "rms_norm_heads",
    "gelu_tanh_and_mul",
)


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
    """Per declared block format: core a decode case and two with M > 1 in fp32 (and one in the default dtype; the
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
        # M > 1: a few rows (decode batches) and past 32 (where kernels leave the per-row path)
        cases += [QuantCase(fmt, f32, m, 576, 197, True, "contiguous", "core") for m in (7, 37)]
        if default_dtype != f32 and default_dtype in KNOWN_DTYPES:
            cases.append(QuantCase(fmt, default_dtype, 5, 576, 197, True, "contiguous", "core"))
        cases += [QuantCase(fmt, f32, m, k, n, b, layout, "extended") for m, k, n, b, layout in QUANT_SHAPES]
        others = [d for d in _dtypes(caps) if d != f32]
        cases += [QuantCase(fmt, dtype, 5, 576, 197, True, "contiguous", "extended") for dtype in others]
    return _dedupe(cases)
