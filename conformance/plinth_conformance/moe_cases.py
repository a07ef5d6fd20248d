"""Fused mixture-of-experts cases (plugin API 1.8, suite 1.5), for a backend that declares
``Capabilities.fused_moe``.

Axes: expert counts 1, 8 and 64 with top-k 1, 2 and 8 (where k <= E); how the router spreads the
tokens (:data:`ROUTINGS`, forced by constructed router logits, see :mod:`.moe`); token batches of
1 up to 2048; renormalisation on and off; every declared dtype, activation and quantized format;
``x`` and the router logits as views into NaN-guarded buffers. Cases a backend's declared limits
(``max_experts``, ``max_top_k``) exclude are not generated; those are :class:`MoEUndeclaredCase`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from plinth.platform.backend import Capabilities, MoECapabilities, MoESpec
from plinth.platform.quant import QUANT_BLOCKS
from plinth.platform.values import MOE_ACTIVATIONS
from plinth_conformance.case_base import _SHORT, KNOWN_DTYPES, MANDATORY_DTYPE, case_seed

#: How the constructed router logits send tokens to experts:
#: "spread": each token picks k distinct experts at random (uneven, random group sizes);
#: "one-expert": every token picks the same k experts (top-1: one expert gets every token);
#: "all-experts": token t's first choice is expert t mod E, so every expert gets a group;
#: "uneven": first choices skewed (about 60% to one expert, a long tail, some experts get none);
#: "idle-experts": only the first half of the experts is ever picked (groups of zero rows).
ROUTINGS: tuple[str, ...] = ("spread", "one-expert", "all-experts", "uneven", "idle-experts")


@dataclass(frozen=True, slots=True)
class MoECase:
    """One ``MoEKernels.forward`` over ``tokens`` tokens; ``skip`` for the placeholder of a backend
    that declares no fused-MoE op (it says why nothing was checked)."""

    experts: int
    top_k: int
    tokens: int
    routing: str
    dtype: str
    tier: str
    activation: str = "silu"
    renormalize: bool = True
    quant: str | None = None
    guarded: bool = False  # x and the router logits are views into NaN-filled buffers
    hidden: int = 64
    inter: int = 32
    skip: str | None = None

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``moe-f32-e8k2-t37-spread-h64i32`` (``-norenorm``, ``-gelu_tanh``,
        ``-q8_0``, ``-guarded`` when they apply)."""
        if self.skip is not None:
            return "moe-none-declared"
        return (
            f"moe-{_SHORT[self.dtype]}-e{self.experts}k{self.top_k}-t{self.tokens}-{self.routing}"
            f"-h{self.hidden}i{self.inter}"
            + ("" if self.renormalize else "-norenorm")
            + ("" if self.activation == "silu" else f"-{self.activation}")
            + ("" if self.quant is None else f"-{self.quant}")
            + ("-guarded" if self.guarded else "")
        )

    @property
    def seed(self) -> int:
        """See :func:`case_seed`."""
        return case_seed(self.id)

    @property
    def spec(self) -> MoESpec:
        """The op's spec."""
        return MoESpec(
            self.experts,
            self.top_k,
            self.hidden,
            self.inter,
            dtype=self.dtype,
            renormalize=self.renormalize,
            activation=self.activation,
            quant_format=self.quant,
        )

    @property
    def twice(self) -> bool:
        """Run ``forward`` twice (bit-identical): the core base case and every batch of 64 or more."""
        return self.tokens >= 64 or (self.tier == "core" and self.tokens == 37 and not self.guarded)


def _declared(moe: MoECapabilities, case: MoECase) -> bool:
    return not moe.unsupported(case.spec)


def moe_cases(caps: Capabilities, default_dtype: str) -> list[MoECase]:
    """Core: the base case (8 experts, top-2, 37 tokens) contiguous, guarded and twice, a decode
    token and no renormalisation, in float32 (or the first declared dtype); extended: the axes of
    the module docstring. Only cases the declaration covers; a placeholder when none is declared."""
    moe = caps.fused_moe
    if moe is None:
        why = "no fused-MoE op declared (Capabilities.fused_moe is None): the core runs the reference op"
        return [MoECase(1, 1, 0, "spread", MANDATORY_DTYPE, "extended", skip=why)]
    dtypes = [d for d in KNOWN_DTYPES if d in moe.dtypes]
    if not dtypes:
        return []
    home = MANDATORY_DTYPE if MANDATORY_DTYPE in dtypes else dtypes[0]
    acts = [a for a in sorted(MOE_ACTIVATIONS) if a in moe.activations]
    act = "silu" if "silu" in acts else acts[0]
    base = MoECase(8, 2, 37, "spread", home, "core", activation=act)
    cases = [
        base,
        replace(base, guarded=True),
        replace(base, tokens=1),
        replace(base, tokens=16, renormalize=False),
    ]
    ext = replace(base, tier="extended")
    for e, k in ((1, 1), (8, 1), (8, 2), (8, 8), (64, 1), (64, 2), (64, 8)):
        cases.append(replace(ext, experts=e, top_k=k, tokens=33))
    cases += [
        replace(ext, experts=8, top_k=1, tokens=33, routing="one-expert"),
        replace(ext, experts=64, top_k=2, tokens=33, routing="one-expert"),
        replace(ext, experts=8, top_k=2, tokens=40, routing="all-experts"),
        replace(ext, experts=64, top_k=2, tokens=80, routing="all-experts"),
        replace(ext, experts=8, top_k=2, tokens=64, routing="uneven"),
        replace(ext, experts=64, top_k=8, tokens=64, routing="uneven"),
        replace(ext, experts=64, top_k=8, tokens=5, routing="idle-experts"),
        replace(ext, experts=8, top_k=2, tokens=2),
        replace(ext, experts=64, top_k=8, tokens=1),
        replace(ext, experts=8, top_k=2, tokens=2048),
        replace(ext, experts=64, top_k=8, tokens=2048, routing="all-experts"),
        replace(ext, experts=64, top_k=8, tokens=33, renormalize=False),
        replace(ext, experts=8, top_k=1, tokens=33, renormalize=False),
        replace(ext, experts=64, top_k=8, tokens=37, guarded=True),
        replace(ext, hidden=256, inter=96, tokens=37),  # wider than one tile, I no power of two
    ]
    for dtype in dtypes:
        for a in acts:
            cases.append(replace(ext, dtype=dtype, activation=a))
            cases.append(replace(ext, dtype=dtype, activation=a, experts=64, top_k=8, tokens=64, guarded=True))
    for fmt in sorted(moe.quant_formats):
        if fmt not in QUANT_BLOCKS:
            continue  # the core never hands the backend experts in a format it does not define
        q = replace(ext, quant=fmt, hidden=128, inter=64)
        cases += [replace(q, tokens=1), replace(q, tokens=5), replace(q, tokens=37)]
        cases.append(replace(q, experts=64, top_k=8, tokens=40, routing="all-experts"))
        cases.append(replace(q, tokens=37, guarded=True))
        cases += [replace(q, tokens=37, activation=a) for a in acts if a != act]
        cases += [replace(q, tokens=5, dtype=d) for d in dtypes if d != home]
    if default_dtype != home and default_dtype in dtypes:
        cases.append(replace(base, dtype=default_dtype, guarded=True))
    seen: dict[str, MoECase] = {}
    for case in cases:
        if _declared(moe, case):
            seen.setdefault(case.id, case)
    return list(seen.values())


@dataclass(frozen=True, slots=True)
class MoEUndeclaredCase:
    """A fused-MoE spec outside the declaration: ``moe_kernels`` (or at the latest ``prepare`` /
    ``forward``) must raise ``NotSupported``."""

    what: str
    spec: MoESpec
    tier: str = "core"
    skip: str | None = None  # the placeholder of a backend that declares every value

    @property
    def id(self) -> str:
        """The pytest id, e.g. ``undeclared-moe-dtype-f16``."""
        return f"undeclared-moe-{self.what}"

    @property
    def seed(self) -> int:
        """See :func:`case_seed`."""
        return case_seed(self.id)


def moe_undeclared_cases(caps: Capabilities, default_dtype: str) -> list[MoEUndeclaredCase]:
    """No op declared: any spec. Declared: the first undeclared dtype, activation and known block
    format, and one past ``max_experts`` / ``max_top_k``."""
    base = MoESpec(8, 2, 64, 32)
    moe = caps.fused_moe
    if moe is None:
        return [MoEUndeclaredCase("op", base)]
    home = MANDATORY_DTYPE if MANDATORY_DTYPE in moe.dtypes else next(iter(sorted(moe.dtypes)), MANDATORY_DTYPE)
    act = "silu" if "silu" in moe.activations else next(iter(sorted(moe.activations)), "silu")
    base = replace(base, dtype=home, activation=act)
    cases: list[MoEUndeclaredCase] = []
    if (d := next((d for d in KNOWN_DTYPES if d not in moe.dtypes), None)) is not None:
        cases.append(MoEUndeclaredCase(f"dtype-{_SHORT[d]}", replace(base, dtype=d)))
    if (a := next((a for a in sorted(MOE_ACTIVATIONS) if a not in moe.activations), None)) is not None:
        cases.append(MoEUndeclaredCase(f"activation-{a}", replace(base, activation=a)))
    if (f := next((f for f in sorted(QUANT_BLOCKS) if f not in moe.quant_formats), None)) is not None:
        cases.append(MoEUndeclaredCase(f"quant-{f}", replace(base, quant_format=f)))
    if moe.max_experts is not None:
        e = moe.max_experts + 1
        cases.append(MoEUndeclaredCase(f"experts-{e}", replace(base, num_experts=e)))
    if moe.max_top_k is not None:
        k = moe.max_top_k + 1
        cases.append(MoEUndeclaredCase(f"top-k-{k}", replace(base, num_experts=max(k, 8), top_k=k)))
    cases = [c for c in cases if moe.unsupported(c.spec)]
    if not cases:
        why = "every dtype, activation and block format the suite knows is declared, with no expert or top-k limit"
        return [MoEUndeclaredCase("none", base, skip=why)]
    return cases
