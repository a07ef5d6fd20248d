"""GEMM: ``x [M, K] @ w.T (+ b)`` for unaligned and real-model shapes, M from 1 to 2048, with
transposed and strided operands.

The ``x-strided`` layout passes ``x`` as a view into a NaN-filled buffer with a wider row stride
(guards on every side): a kernel that assumes contiguity, or reads past K, reads NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from plinth.platform.backend import Backend, torch_dtype
from plinth.platform.reference import ReferenceGemm
from plinth_conformance.cases import GemmCase
from plinth_conformance.checks import check_repeat, declared_gemm, kernel_call
from plinth_conformance.tolerance import bits, compare


def _operands(case: GemmCase, device: torch.device, gen: torch.Generator):  # noqa: ANN202
    """(x, w, b) rounded to the case's dtype, and (x_in, w_in, buffers) as the kernel gets them."""
    dtype = torch_dtype(case.dtype)
    m, k, n = case.m, case.k, case.n
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if case.bias else None
    layouts = set(case.layout.split("+"))  # each operand's layout varies on its own
    if "x-transposed" in layouts:
        x_buf = x.t().contiguous().to(device)  # [K, M]
        x_in = x_buf.t()
    elif "x-strided" in layouts:
        x_buf = torch.full((m + 2, k + 8), float("nan"), dtype=dtype, device=device)  # NaN guards around x
        x_buf[1 : m + 1, 3 : k + 3] = x.to(device)
        x_in = x_buf[1 : m + 1, 3 : k + 3]
    else:
        x_buf = x.to(device)
        x_in = x_buf
    w_in = w.t().contiguous().t() if "w-transposed" in layouts else w  # [N, K], column-major
    return (x, w, b), (x_in, w_in, x_buf)


def test_gemm(plinth_backend: Backend, gemm_case: GemmCase, record_tolerance: Callable[..., None]) -> None:
    """prepare() then linear() matches the fp64 product within calibrated bounds; inputs untouched."""
    case = gemm_case
    gen = torch.Generator().manual_seed(case.seed)
    device = plinth_backend.device_services().device
    (x, w, b), (x_in, w_in, x_buf) = _operands(case, device, gen)
    gemm = declared_gemm(plinth_backend, case.dtype, case.id)
    x_bits, w_bits = bits(x_buf).clone(), bits(w_in).clone()
    with kernel_call(case.id, "prepare()"):
        weight = gemm.prepare(w_in, b)
    with kernel_call(case.id, "linear()"):
        out = gemm.linear(x_in, weight)
        plinth_backend.device_services().synchronize()
    if case.twice:
        out = out.clone()  # a kernel may hand back a reused buffer
        with kernel_call(case.id, "linear() (again)"):
            again = gemm.linear(x_in, weight)
            plinth_backend.device_services().synchronize()
        check_repeat(plinth_backend, case.id, out, again)
    assert torch.equal(bits(x_buf), x_bits), f"[{case.id}] linear() modified its input (or the guards around it)"
    assert torch.equal(bits(w_in), w_bits), f"[{case.id}] prepare() modified the weight it was given"
    assert out.dtype == x.dtype, f"[{case.id}] output dtype {out.dtype}, expected {x.dtype}"
    gold = x.double() @ w.double().t()
    if b is not None:
        gold += b.double()
    ref = ReferenceGemm(x.dtype)
    naive = ref.linear(x, ref.prepare(w, b))
    verdict = compare(out.cpu(), gold, naive, case.k)
    record_tolerance(case.id, case.dtype, verdict)
    where = ""
    if verdict.worst_index is not None:
        row, col = divmod(verdict.worst_index, case.n)
        where = f"; worst at row {row}, column {col} (M={case.m}, K={case.k}, N={case.n})"
    assert verdict.ok, verdict.message(case.id) + where


#: (M, K, N) of the stored-dtype cases: a decode row, an unaligned K, a prefill-sized product.
STORED_SHAPES = ((1, 96, 45), (7, 255, 33), (100, 512, 200))


def test_gemm_takes_weights_as_stored(plinth_backend: Backend) -> None:
    """Plugin API 1.14: a GEMM listing ``stored_dtypes`` gets such weights as the checkpoint stored
    them (a bf16 weight in an fp32 model) and must compute the model's product of their values: the
    output in the model's dtype, within the bounds of the fp64 product of the stored values, and
    the weight left as it was. Run for every declared dtype whose GEMM lists another stored dtype."""
    ran = []
    for dtype in sorted(plinth_backend.capabilities().dtypes):
        gemm = declared_gemm(plinth_backend, dtype, f"gemm-stored-{dtype}")
        model_dtype = torch_dtype(dtype)
        device = plinth_backend.device_services().device
        for stored in sorted(gemm.stored_dtypes - {model_dtype}, key=str):
            for m, k, n in STORED_SHAPES:
                case_id = f"gemm-stored-{str(stored).removeprefix('torch.')}-in-{dtype}-{m}x{k}x{n}"
                gen = torch.Generator().manual_seed(m * 1000 + k + n)
                w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(stored)
                x, b = torch.randn(m, k, generator=gen).to(model_dtype), torch.randn(n, generator=gen).to(model_dtype)
                w_in = w.to(device)
                w_bits = bits(w_in).clone()
                with kernel_call(case_id, "prepare()"):
                    weight = gemm.prepare(w_in, b.to(device))
                with kernel_call(case_id, "linear()"):
                    out = gemm.linear(x.to(device), weight)
                    plinth_backend.device_services().synchronize()
                assert torch.equal(bits(w_in), w_bits), f"[{case_id}] prepare() modified the weight it was given"
                assert out.dtype == model_dtype, f"[{case_id}] output dtype {out.dtype}, expected {model_dtype}"
                gold = x.double() @ w.double().t() + b.double()
                ref = ReferenceGemm(model_dtype)
                naive = ref.linear(x, ref.prepare(w.to(model_dtype), b))
                verdict = compare(out.cpu(), gold, naive, k)
                assert verdict.ok, verdict.message(case_id)
                ran.append(case_id)
    if not ran:
        pytest.skip("no GEMM lists a stored dtype other than its own (GemmKernels.stored_dtypes, plugin API 1.14)")
