"""SmallOps (rms_norm, add_rms_norm, silu_and_mul, rotary, and since suite 1.6 rms_norm_heads and
gelu_tanh_and_mul) against the plain-torch defaults in fp64.

Shapes are SmolLM2's: hidden 576, intermediate 1536, 9 heads of 64. The ops must not modify
their inputs (a rotary applied in place would corrupt the query a caller still holds), with one
documented exception: ``add_rms_norm`` (API 1.1) may overwrite ``residual`` with the sum it
returns. The suite requires neither behaviour, only that ``residual`` afterwards holds either its
old bits or exactly the returned sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plinth.platform.backend import Backend, SmallOps, torch_dtype
from plinth_conformance.cases import OpsCase
from plinth_conformance.checks import check_repeat, kernel_call
from plinth_conformance.tolerance import bits, compare

TOKENS, HIDDEN, INTERMEDIATE, HEADS, HEAD_SIZE, MAX_POS = 33, 576, 1536, 9, 64, 512


def _cos_sin(rotary_dim: int) -> torch.Tensor:
    """[MAX_POS, rotary_dim] fp32: cos in the first half, sin in the second (the model's table)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float()


def _laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` [T, ..., W] itself, or (``strided``) the same values as a view into a wider buffer
    (a row stride past the width and a storage offset, as a slice of a fused projection has)."""
    if layout != "strided":
        return x
    flat = x.reshape(x.shape[0], -1)
    wide = torch.full((x.shape[0], flat.shape[1] + 96), float("nan"), dtype=x.dtype)
    wide[:, 32 : 32 + flat.shape[1]] = flat
    return wide[:, 32 : 32 + flat.shape[1]].view(x.shape)


def _run(case: OpsCase, gen: torch.Generator) -> tuple[Callable[[SmallOps, bool], torch.Tensor], list[torch.Tensor]]:
    """A function computing the op with ``ops`` (in fp64 when asked), and its inputs."""
    dtype = torch_dtype(case.dtype)
    if case.op == "rms_norm":
        x = _laid_out((torch.randn(TOKENS, HIDDEN, generator=gen) * case.magnitude).to(dtype), case.layout)
        w = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)

        def rms(o: SmallOps, fp64: bool) -> torch.Tensor:
            return o.rms_norm(x.double(), w.double(), 1e-5) if fp64 else o.rms_norm(x, w, 1e-5)

        return rms, [x, w]
    if case.op in ("silu_and_mul", "gelu_tanh_and_mul"):
        x = _laid_out(torch.randn(TOKENS, 2 * INTERMEDIATE, generator=gen).mul(2).to(dtype), case.layout)
        op = case.op

        def act(o: SmallOps, fp64: bool) -> torch.Tensor:
            return getattr(o, op)(x.double() if fp64 else x)

        return act, [x]
    if case.op == "rms_norm_heads":  # Qwen3's q/k norm: heads of 64 dense, a token stride past them
        x = _laid_out(torch.randn(TOKENS, HEADS, HEAD_SIZE, generator=gen).mul(3).to(dtype), case.layout)
        w = (1 + 0.1 * torch.randn(HEAD_SIZE, generator=gen)).to(dtype)

        def heads(o: SmallOps, fp64: bool) -> torch.Tensor:
            return o.rms_norm_heads(x.double(), w.double(), 1e-6) if fp64 else o.rms_norm_heads(x, w, 1e-6)

        return heads, [x, w]
    x = _laid_out(torch.randn(TOKENS, HEADS, HEAD_SIZE, generator=gen).to(dtype), case.layout)
    positions = torch.randint(0, MAX_POS, (TOKENS,), generator=gen)
    table = _cos_sin(case.rotary_dim)

    def rotary(o: SmallOps, fp64: bool) -> torch.Tensor:
        if fp64:
            return o.rotary(x.double(), positions, table.double(), case.rotary_dim)
        return o.rotary(x, positions, table, case.rotary_dim)

    return rotary, [x, positions, table]


def _check_add_rms_norm(
    backend: Backend, case: OpsCase, ops: SmallOps, gen: torch.Generator, record_tolerance: Callable[..., None]
) -> None:
    """``(rms_norm(x + residual), x + residual)``; x and weight untouched, residual old or the sum."""
    dtype = torch_dtype(case.dtype)
    x = (torch.randn(TOKENS, HIDDEN, generator=gen) * case.magnitude).to(dtype)
    # the stream dominates, as in a model
    residual = (4 * case.magnitude * torch.randn(TOKENS, HIDDEN, generator=gen)).to(dtype)
    w = (1 + 0.1 * torch.randn(HIDDEN, generator=gen)).to(dtype)
    res_in = residual.clone()  # the call may overwrite it
    x_bits, w_bits, res_bits = bits(x).clone(), bits(w).clone(), bits(res_in).clone()
    with kernel_call(case.id, "add_rms_norm()"):
        result = ops.add_rms_norm(x, res_in, w, 1e-5)
    assert isinstance(result, tuple) and len(result) == 2, f"[{case.id}] add_rms_norm() must return (normed, sum)"
    normed, total = result
    again = ops.add_rms_norm(x, residual.clone(), w, 1e-5)  # the same inputs: the same bits
    for first, second in zip((normed, total), again, strict=True):
        check_repeat(backend, case.id, first, second)
    assert torch.equal(bits(x), x_bits) and torch.equal(bits(w), w_bits), (
        f"[{case.id}] add_rms_norm() modified x or the weight"
    )
    assert torch.equal(bits(res_in), res_bits) or torch.equal(bits(res_in), bits(total)), (
        f"[{case.id}] add_rms_norm() left residual neither unchanged nor equal to the sum it returned"
    )
    default = SmallOps()
    gold_norm, gold_sum = default.add_rms_norm(x.double(), residual.double(), w.double(), 1e-5)
    naive_norm, naive_sum = default.add_rms_norm(x, residual.clone(), w, 1e-5)
    for what, out, gold, naive in (("sum", total, gold_sum, naive_sum), ("norm", normed, gold_norm, naive_norm)):
        assert out.dtype == dtype, f"[{case.id}] the {what} is {out.dtype}, expected {dtype}"
        verdict = compare(out.cpu(), gold, naive, HIDDEN if what == "norm" else 1)
        record_tolerance(f"{case.id}:{what}", case.dtype, verdict)
        assert verdict.ok, verdict.message(f"{case.id}:{what}")


def test_small_ops(plinth_backend: Backend, ops_case: OpsCase, record_tolerance: Callable[..., None]) -> None:
    """The backend's op matches the default op computed in fp64 from the same rounded inputs."""
    case = ops_case
    gen = torch.Generator().manual_seed(case.seed)
    with kernel_call(case.id, "small_ops()"):
        ops = plinth_backend.small_ops()
    if case.op == "add_rms_norm":
        _check_add_rms_norm(plinth_backend, case, ops, gen, record_tolerance)
        return
    fn, inputs = _run(case, gen)
    before = [bits(t).clone() for t in inputs]
    with kernel_call(case.id, f"{case.op}()"):
        out = fn(ops, False).clone()  # a kernel may hand back a reused buffer
        again = fn(ops, False)
    check_repeat(plinth_backend, case.id, out, again)
    assert all(torch.equal(bits(t), b) for t, b in zip(inputs, before, strict=True)), (
        f"[{case.id}] {case.op}() modified its inputs"
    )
    default = SmallOps()
    verdict = compare(out.cpu(), fn(default, True), fn(default, False), HIDDEN)
    record_tolerance(case.id, case.dtype, verdict)
    assert verdict.ok, verdict.message(case.id)
