"""Quantized GEMM (plugin API 1.1): ``prepare_quantized`` then ``linear`` for every block format a
backend declares in ``Capabilities.quant_formats``.

The golden result is the fp64 product with ``plinth.platform.quant.dequantize(weight)``; the int8 rounding
of activations llama.cpp-style kernels do is forgiven up to its worst case per element (see
:mod:`plinth_conformance.quantized`), the rest is gated like any GEMM. Blocks, activations (also
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
    activation_rounding_allowance,
    blocks_bytes,
    prepared_bytes,
    random_activations,
    random_weight,
)
from plinth_conformance.tolerance import bits, compare


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
    gold = x.double() @ w.double().t()
    if b is not None:
        gold += b.double()
    ref = ReferenceGemm(dtype)
    naive = ref.linear(x, ref.prepare(w, b))
    allowance = activation_rounding_allowance(x, w)
    verdict = compare(
        out.cpu(), gold, naive, case.k, allowance=allowance, allowance_name="int8 activation-rounding allowance"
    )
    record_tolerance(case.id, case.dtype, verdict)
    record_quantized(
        case=case.id,
        format=case.fmt,
        shape=[case.n, case.k],
        blocks_bytes=blocks_bytes(weight),
        prepared_bytes=prepared_bytes(prepared),
        prepared_format=prepared.format,
    )
    where = ""
    if verdict.worst_index is not None:
        row, col = divmod(verdict.worst_index, case.n)
        where = f"; worst at row {row}, column {col} (M={case.m}, K={case.k}, N={case.n}, {case.fmt})"
    assert verdict.ok, verdict.message(case.id) + where
