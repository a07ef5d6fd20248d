"""Triton RMSNorm and rotary against plinth's default SmallOps, in the interpreter."""

from __future__ import annotations

import pytest
import torch

from plinth.platform.backend import SmallOps

pytestmark = pytest.mark.triton_interpret


def _ops() -> SmallOps:
    from plinth_triton.ops import InterpreterTarget, TritonSmallOps

    return TritonSmallOps(InterpreterTarget())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rms_norm(dtype: torch.dtype, tol: float) -> None:
    """A hidden size that is not a power of two, rows not a multiple of the row tile."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(19, 96, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    before = x.clone()
    out = _ops().rms_norm(x, w, 1e-5)
    assert out.dtype == dtype and torch.equal(x, before)
    torch.testing.assert_close(out.float(), SmallOps().rms_norm(x, w, 1e-5).float(), rtol=tol, atol=tol)


def test_add_rms_norm() -> None:
    """residual += x in place, then the norm of the sum (and the sum, as the residual itself)."""
    gen = torch.Generator().manual_seed(1)
    x, residual = torch.randn(2, 7, 40, generator=gen)
    w = torch.randn(40, generator=gen)
    want_residual = x + residual
    out, summed = _ops().add_rms_norm(x, residual, w, 1e-6)
    assert summed is residual
    torch.testing.assert_close(residual, want_residual)
    torch.testing.assert_close(out, SmallOps().rms_norm(want_residual, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["full", "partial"])
def test_rotary(rotary_dim: int) -> None:
    """NeoX rotate-half on a strided query view (from a fused qkv), full and partial rotary dims."""
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(11, 5 * 32, generator=gen)
    x = qkv[:, : 3 * 32].view(11, 3, 32)  # 3 heads, row stride 160
    positions = torch.randint(0, 64, (11,), generator=gen)
    freqs = torch.arange(64.0)[:, None] / (100.0 ** (torch.arange(0, rotary_dim, 2) / rotary_dim))
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    before = qkv.clone()
    out = _ops().rotary(x, positions, cos_sin, rotary_dim)
    torch.testing.assert_close(out, SmallOps().rotary(x, positions, cos_sin, rotary_dim), rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv, before)


def test_float64_uses_the_torch_defaults() -> None:
    """fp64 (the conformance suite's golden dtype) is not a kernel dtype: the defaults answer."""
    x = torch.randn(3, 2, 16, dtype=torch.float64)
    cos_sin = torch.randn(8, 16, dtype=torch.float64)
    pos = torch.tensor([0, 5, 7])
    assert torch.equal(_ops().rotary(x, pos, cos_sin, 16), SmallOps().rotary(x, pos, cos_sin, 16))
    w = torch.randn(16, dtype=torch.float64)
    assert torch.equal(_ops().rms_norm(x, w, 1e-6), SmallOps().rms_norm(x, w, 1e-6))
