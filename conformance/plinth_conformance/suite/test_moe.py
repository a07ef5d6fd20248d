"""Fused mixture-of-experts (plugin API 1.8): ``moe_kernels(spec)``, ``prepare`` (or
``prepare_quantized``) then ``forward`` for every case the backend declares in
``Capabilities.fused_moe``, against the fp64 op (see :mod:`plinth_conformance.moe`); an
undeclared spec must raise ``NotSupported``.

Expert weights, ``x`` and the router logits must come back unchanged; in the ``guarded`` cases
``x`` and the logits are views into NaN-filled buffers, so a kernel that reads past a row (or
assumes contiguity) puts NaN into the output, and one that writes past it changes the guards.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from plinth.platform.backend import Backend, MoEKernels, NotSupported, torch_dtype
from plinth.platform.reference import ReferenceMoE
from plinth_conformance.checks import check_repeat, kernel_call
from plinth_conformance.moe import (
    dense_experts,
    dense_gold,
    gold_routing,
    guarded,
    quantized_experts,
    quantized_gold,
    router_logits,
)
from plinth_conformance.moe_cases import MoECase, MoEUndeclaredCase
from plinth_conformance.tolerance import bits, compare


def _declared_moe(backend: Backend, case: MoECase) -> MoEKernels:
    with kernel_call(case.id, "moe_kernels()"):
        return backend.moe_kernels(case.spec)
    raise AssertionError("unreachable")  # pragma: no cover - kernel_call re-raises


def test_fused_moe(plinth_backend: Backend, moe_case: MoECase, record_tolerance: Callable[..., None]) -> None:
    """forward() is the fp64 op within calibrated bounds; inputs, weights and guards untouched."""
    case = moe_case
    if case.skip is not None:
        pytest.skip(case.skip)
    gen = torch.Generator().manual_seed(case.seed)
    dtype = torch_dtype(case.dtype)
    device = plinth_backend.device_services().device
    logits = router_logits(case, gen).to(dtype)  # [T, E], the case's dtype as a model's router gives it
    x = torch.randn(case.tokens, case.hidden, generator=gen).to(dtype)  # [T, H]
    if case.guarded:
        x_in, x_buf = guarded(x, device)
        logits_in, logits_buf = guarded(logits, device)
    else:
        x_in = x_buf = x.to(device)
        logits_in = logits_buf = logits.to(device)
    _, ids = gold_routing(logits, case.top_k, case.renormalize)
    kernels = _declared_moe(plinth_backend, case)
    ref = ReferenceMoE(case.spec)
    if case.quant is None:
        gate_up, down = dense_experts(case, gen)
        w_bits = [bits(gate_up).clone(), bits(down).clone()]
        with kernel_call(case.id, "prepare()"):
            weights = kernels.prepare(gate_up.to(device), down.to(device))
        unchanged = torch.equal(bits(gate_up), w_bits[0]) and torch.equal(bits(down), w_bits[1])
        gold, allowance = dense_gold(x, logits, gate_up, down, case), None
        naive = ref.forward(x, logits, ref.prepare(gate_up, down))
    else:
        gate_up_q, down_q = quantized_experts(case, gen)
        w_bits = [w.blocks.clone() for w in (*gate_up_q, *down_q)]
        with kernel_call(case.id, "prepare_quantized()"):
            weights = kernels.prepare_quantized(gate_up_q, down_q)
        unchanged = all(torch.equal(w.blocks, b) for w, b in zip((*gate_up_q, *down_q), w_bits, strict=True))
        gold, allowance = quantized_gold(x, logits, gate_up_q, down_q, case)
        naive = ref.forward(x, logits, ref.prepare_quantized(gate_up_q, down_q))
    assert unchanged, f"[{case.id}] prepare() modified the expert weights it was given"
    x_bits, logits_bits = bits(x_buf).clone(), bits(logits_buf).clone()
    with kernel_call(case.id, "forward()"):
        out = kernels.forward(x_in, logits_in, weights)
        plinth_backend.device_services().synchronize()
    if case.twice:
        out = out.clone()  # a kernel may hand back a reused buffer
        with kernel_call(case.id, "forward() (again)"):
            again = kernels.forward(x_in, logits_in, weights)
            plinth_backend.device_services().synchronize()
        check_repeat(plinth_backend, case.id, out, again)
    assert torch.equal(bits(x_buf), x_bits), f"[{case.id}] forward() modified x (or the guards around it)"
    assert torch.equal(bits(logits_buf), logits_bits), f"[{case.id}] forward() modified the router logits (or guards)"
    assert out.dtype == dtype, f"[{case.id}] output dtype {out.dtype}, expected {dtype}"
    name = "quantized-activation allowance" if allowance is not None else "allowance"
    verdict = compare(out.cpu(), gold, naive, case.hidden + case.inter, allowance=allowance, allowance_name=name)
    record_tolerance(case.id, case.dtype, verdict)
    where = ""
    if verdict.worst_index is not None:
        row, col = divmod(verdict.worst_index, case.hidden)
        experts = ids[row].tolist()
        where = f"; worst at token {row} (routed to experts {experts}), column {col}"
    assert verdict.ok, verdict.message(case.id) + where


def test_undeclared_moe_raises_not_supported(plinth_backend: Backend, moe_undeclared_case: MoEUndeclaredCase) -> None:
    """An undeclared fused-MoE spec raises NotSupported (when asked for, or at the latest when run)."""
    case = moe_undeclared_case
    if case.skip is not None:
        pytest.skip(case.skip)
    spec = case.spec
    device = plinth_backend.device_services().device
    try:
        kernels = plinth_backend.moe_kernels(spec)
        dtype = torch_dtype(spec.dtype)
        e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        weights = kernels.prepare(torch.zeros(e, 2 * i, h, dtype=dtype), torch.zeros(e, h, i, dtype=dtype))
        kernels.forward(torch.ones(2, h, dtype=dtype, device=device), torch.zeros(2, e, device=device), weights)
    except NotSupported:
        return
    except Exception as exc:
        pytest.fail(f"[{case.id}] undeclared, and raised {type(exc).__name__} instead of NotSupported: {exc}",
                    pytrace=False)  # fmt: skip
    pytest.fail(f"[{case.id}] undeclared, but the backend returned numbers instead of raising NotSupported",
                pytrace=False)  # fmt: skip
