"""Calibrated comparison of a backend's output with the fp64 golden result.

No magic epsilons: the golden result is computed in fp64 from the *already rounded* inputs, and a
naive computation in the backend's own dtype (the reference backend's kernel run in that dtype) is
compared with the same golden result. Its error is what "computed correctly in this dtype" costs;
the backend may be up to ``factor`` times worse.

A floor keeps a naive result that happens to be exact (fp64: the naive computation *is* the golden
one) from demanding exactness. It is the textbook error model of a reduction of length ``n``:
rounding the output (a few ``eps`` of the output dtype) plus a random-walk accumulation error
(``sqrt(n)`` ``eps`` of the accumulator: fp64 for fp64, fp32 for everything else).

Three gates, each reported with its threshold:

* norm-wise relative error ``||out - gold|| / ||gold||``;
* element pass rate: the share of elements whose scaled error is within the typical-element
  threshold (catches a wrong row hidden in a large, mostly right output);
* maximum scaled error (catches a single wildly wrong element).

The scaled error of an element is ``|out - gold| / (|gold| + rms(gold))``: relative for large
elements, absolute (in units of the output's typical size) for those near zero.

An ``allowance`` (an absolute error per element that a documented approximation may cost, e.g. the
int8 activation rounding of a quantized GEMM, see :mod:`.quantized`) is forgiven first: the gates
then apply to ``max(|out - gold| - allowance, 0)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class TolerancePolicy:
    """How much worse than the naive same-dtype computation a backend may be.

    Floors are in units of the output dtype's machine epsilon.
    """

    factor: float = 8.0
    # floor = out_eps * output-dtype eps + acc_eps * accumulator eps * sqrt(reduction length)
    rel_floor_out_eps: float = 1.0
    rel_floor_acc_eps: float = 2.0
    elem_floor_out_eps: float = 1.0
    elem_floor_acc_eps: float = 4.0
    max_floor_out_eps: float = 2.0
    max_floor_acc_eps: float = 16.0
    min_pass_rate: float = 0.99
    elem_quantile: float = 0.99

    def floors(self, dtype: torch.dtype, reduction: int) -> tuple[float, float, float]:
        """``(relative, element, max)`` floors for an output of ``dtype`` reduced over ``reduction`` terms."""
        out = float(torch.finfo(dtype).eps)
        acc = float(torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps)
        walk = acc * math.sqrt(max(reduction, 1))
        return (
            self.rel_floor_out_eps * out + self.rel_floor_acc_eps * walk,
            self.elem_floor_out_eps * out + self.elem_floor_acc_eps * walk,
            self.max_floor_out_eps * out + self.max_floor_acc_eps * walk,
        )

    def as_dict(self) -> dict[str, float]:
        """The policy as plain numbers, for certificates."""
        return asdict(self)


#: The policy every comparison of this suite version uses.
POLICY = TolerancePolicy()


@dataclass(slots=True)
class Verdict:
    """The outcome of one comparison: the gates, the measured errors and the thresholds."""

    ok: bool
    reasons: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    worst_index: int | None = None  # flat index of the worst element, for locating the bug

    def message(self, case_id: str) -> str:
        """One line naming the case and every failed gate."""
        return f"[{case_id}] " + "; ".join(self.reasons)


def _excess(out: torch.Tensor, gold: torch.Tensor, allowance: torch.Tensor | None) -> torch.Tensor:
    """``|out - gold|`` less the allowance, never below 0."""
    err = (out - gold).abs()
    return err if allowance is None else (err - allowance).clamp_min(0.0)


def _scaled_error(out: torch.Tensor, gold: torch.Tensor, allowance: torch.Tensor | None = None) -> torch.Tensor:
    rms = gold.pow(2).mean().sqrt()
    return _excess(out, gold, allowance) / (gold.abs() + rms + torch.finfo(torch.float64).tiny)


def _quantile(x: torch.Tensor, q: float) -> float:
    flat = x.flatten()
    if flat.numel() > 1 << 22:  # torch.quantile refuses huge inputs; a strided sample is plenty
        flat = flat[:: flat.numel() // (1 << 22) + 1]
    return float(torch.quantile(flat, q))


def compare(
    out: torch.Tensor,
    gold: torch.Tensor,
    naive: torch.Tensor,
    reduction: int,
    policy: TolerancePolicy = POLICY,
    allowance: torch.Tensor | None = None,
    allowance_name: str = "allowance",
) -> Verdict:
    """Gate ``out`` (any float dtype) against ``gold`` (fp64) with thresholds calibrated on ``naive``.

    :param out: the backend's result.
    :param gold: the fp64 result from the same (rounded) inputs.
    :param naive: the naive same-dtype result (the reference kernel in ``out``'s dtype).
    :param reduction: the length of the longest sum behind one output element (K of a GEMM).
    :param allowance: absolute error per element (fp64, ``gold``'s shape) forgiven before the gates.
    :param allowance_name: what the allowance stands for, in failure messages.
    """
    reasons: list[str] = []
    if out.shape != gold.shape:
        return Verdict(False, [f"output shape {tuple(out.shape)}, expected {tuple(gold.shape)}"])
    o = out.detach().to("cpu", torch.float64)
    g = gold.detach().to("cpu", torch.float64)
    n = naive.detach().to("cpu", torch.float64)
    bad = ~torch.isfinite(o) & torch.isfinite(g)
    if bad.any():
        first = int(bad.flatten().nonzero()[0])
        return Verdict(
            False,
            [f"{int(bad.sum())} of {o.numel()} elements are NaN/Inf where the fp64 result is finite"],
            {"nonfinite": float(bad.sum())},
            worst_index=first,
        )
    rel_floor, elem_floor, max_floor = policy.floors(out.dtype, reduction)
    a = None if allowance is None else allowance.detach().to("cpu", torch.float64)
    g_norm = float(g.norm()) or 1.0
    rel = float(_excess(o, g, a).norm()) / g_norm
    naive_rel = float((n - g).norm()) / g_norm
    err = _scaled_error(o, g, a)
    naive_err = _scaled_error(n, g)
    tol_rel = max(rel_floor, policy.factor * naive_rel)
    tol_elem = max(elem_floor, policy.factor * _quantile(naive_err, policy.elem_quantile))
    tol_max = max(max_floor, policy.factor * float(naive_err.max()))
    pass_rate = float((err <= tol_elem).double().mean())
    max_err = float(err.max())
    beyond = "" if a is None else f" beyond the {allowance_name}"
    if rel > tol_rel:
        reasons.append(f"relative error{beyond} {rel:.3g} > {tol_rel:.3g} (naive {out.dtype}: {naive_rel:.3g})")
    if pass_rate < policy.min_pass_rate:
        need = f"need {policy.min_pass_rate:.0%}"
        reasons.append(f"only {pass_rate:.2%} of elements within {tol_elem:.3g}{beyond} ({need})")
    if max_err > tol_max:
        reasons.append(f"max scaled error{beyond} {max_err:.3g} > {tol_max:.3g}")
    metrics = {
        "rel": rel,
        "tol_rel": tol_rel,
        "naive_rel": naive_rel,
        "pass_rate": pass_rate,
        "tol_elem": tol_elem,
        "max_err": max_err,
        "tol_max": tol_max,
    }
    if a is not None:
        raw = (o - g).abs()
        metrics["raw_rel"] = float(raw.norm()) / g_norm  # before the allowance
        metrics["allowance_rel"] = float(a.norm()) / g_norm
        # the largest share of its allowance an element that has one used (0: exact; above 1: beyond it)
        given = a > 0  # (elements without an allowance are gated as they are)
        metrics["allowance_used"] = float((raw[given] / a[given]).max()) if bool(given.any()) else 0.0
    return Verdict(not reasons, reasons, metrics, worst_index=int(err.flatten().argmax()))


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as integers of the same width: equality then is bit equality (NaN == NaN)."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(as_int)
