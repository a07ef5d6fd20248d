"""Quantized GEMM (plugin API 1.1): ``prepare_quantized`` then ``linear`` for every block format a
backend declares in ``Capabilities.quant_formats``.

The golden result is the fp64 product with ``plinth.platform.quant.dequantize(weight)`` of the
activations as one of the known roundings leaves them (none, int16 or int8 per 32-block, see
:mod:`plinth_conformance.quantized`): the backend must match one of them within the usual
calibrated thresholds, forgiving only one quantum on activations within fp32 rounding of a
half-way point. The scheme it matched is recorded. Blocks, activations (also
as a view into a NaN-guarded buffer) and bias must be unchanged. The bytes the prepared weight
holds are recorded next to the blocks' (not gated: a dense copy is correct, merely not compact).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from plinth.platform.backend import Backend, torch_dtype
from plinth.platform.quant import dequantize
from plinth.platform.reference import ReferenceGemm
from plinth_conformance.cases import QuantCase
from plinth_conformance.checks import check_repeat, declared_gemm, kernel_call
from plinth_conformance.quantized import (
    ACTIVATION_SCHEMES,
    blocks_bytes,
    minimums,
    prepared_bytes,
    random_activations,
    random_weight,
    rounded_weight,
    scheme_operands,
    tie_allowance,
)
from plinth_conformance.tolerance import Verdict, bits, compare


def test_quantized_gemm(
    plinth_backend: Backend,
    quant_case: QuantCase,
    record_tolerance: Callable[..., None],
    record_quantized: Callable[..., None],
) -> None:
    """The product with the prepared blocks is the fp64 product with the dequantized weight, within
    the activation-rounding allowance plus the usual calibrated thresholds; inputs untouched."""
    case = quant_case
    if case.skip is not None:
        pytest.skip(case.skip)
    gen = torch.Generator().manual_seed(case.seed)
    dtype = torch_dtype(case.dtype)
    device = plinth_backend.device_services().device
    weight = random_weight(case.fmt, case.n, case.k, gen)
    x = random_activations(case.m, case.k, dtype, gen)
    b = torch.randn(case.n, generator=gen).to(dtype) if case.bias else None
    if case.layout == "x-strided":
        x_buf = torch.full((case.m + 2, case.k + 8), float("nan"), dtype=dtype, device=device)  # NaN guards
        x_buf[1 : case.m + 1, 3 : case.k + 3] = x.to(device)
        x_in = x_buf[1 : case.m + 1, 3 : case.k + 3]
    else:
        x_buf = x.to(device)
        x_in = x_buf
    gemm = declared_gemm(plinth_backend, case.dtype, case.id)
    blocks_before, x_bits = weight.blocks.clone(), bits(x_buf).clone()
    b_before = None if b is None else b.clone()
    with kernel_call(case.id, "prepare_quantized()"):
        prepared = gemm.prepare_quantized(weight, b)
    with kernel_call(case.id, "linear()"):
        out = gemm.linear(x_in, prepared)
        plinth_backend.device_services().synchronize()
    if case.twice:
        out = out.clone()  # a kernel may hand back a reused buffer
        with kernel_call(case.id, "linear() (again)"):
            again = gemm.linear(x_in, prepared)
            plinth_backend.device_services().synchronize()
        check_repeat(plinth_backend, case.id, out, again)
    assert torch.equal(weight.blocks, blocks_before), f"[{case.id}] prepare_quantized()/linear() modified the blocks"
    if b is not None and b_before is not None:
        assert torch.equal(bits(b), bits(b_before)), f"[{case.id}] prepare_quantized() modified the bias"
    assert torch.equal(bits(x_buf), x_bits), f"[{case.id}] linear() modified its input (or the guards around it)"
    assert out.dtype == dtype, f"[{case.id}] output dtype {out.dtype}, expected {dtype}"
    w = dequantize(weight)  # [N, K] fp32: the format's reference semantics
    mins = minimums(weight)
    verdicts = {}
    for scheme in ACTIVATION_SCHEMES:
        verdicts[scheme] = verdict = exact_rounding_verdict(out.cpu(), x, w, mins, b, dtype, case.k, scheme)
        if verdict.ok:
            break
    if not verdict.ok:  # report the scheme the output came closest to
        scheme, verdict = min(verdicts.items(), key=lambda kv: kv[1].metrics.get("rel", float("inf")))
    record_tolerance(case.id, case.dtype, verdict)
    record_quantized(
        case=case.id,
        format=case.fmt,
        shape=[case.n, case.k],
        blocks_bytes=blocks_bytes(weight),
        prepared_bytes=prepared_bytes(prepared),
        prepared_format=prepared.format,
        activation_rounding=scheme if verdict.ok else None,
    )
    where = ""
    if verdict.worst_index is not None:
        row, col = divmod(verdict.worst_index, case.n)
        where = f"; worst at row {row}, column {col} (M={case.m}, K={case.k}, N={case.n}, {case.fmt})"
    closest = f"; closest activation rounding: {scheme!r} (of {', '.join(ACTIVATION_SCHEMES)})"
    assert verdict.ok, verdict.message(case.id) + where + closest


def exact_rounding_verdict(
    out: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    mins: torch.Tensor,
    b: torch.Tensor | None,
    dtype: torch.dtype,
    k: int,
    scheme: str,
) -> Verdict:
    """``out`` against the fp64 product of ``x`` rounded by ``scheme`` with ``w`` (+ ``b``); the
    thresholds calibrated on the reference GEMM in ``dtype`` of the same rounded activations."""
    ref = ReferenceGemm(dtype)
    gold = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64) if b is None else b.double().expand(x.shape[0], -1)
    naive = torch.zeros(x.shape[0], w.shape[0], dtype=dtype) if b is None else b.expand(x.shape[0], -1).clone()
    for xs, ws in scheme_operands(x, w, mins, scheme):
        gold = gold + xs.double() @ ws.double().t()
        naive = naive + ref.linear(xs.to(dtype), ref.prepare(ws, None))
    # a tie moves one rounded activation by one quantum, times the weight it multiplies (suite 1.5:
    # w - m for q4_1 under int16, whose minimum term takes the exact sum; 1.4 used w, which can be
    # near 0 where w - m is 15 steps: quant-q4_1-f32-5x256x77-bias-x-strided failed on the cpu backend)
    allowance = tie_allowance(x, rounded_weight(w, mins, scheme), scheme)
    return compare(out, gold, naive, k, allowance=allowance, allowance_name=f"{scheme} rounding-tie allowance")
