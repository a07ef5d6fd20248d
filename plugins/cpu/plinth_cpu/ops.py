"""Norm, activation and rotary ops for the CPU backend: native kernels for fp32, torch otherwise."""

from __future__ import annotations

import torch

from plinth.platform.backend import SmallOps
from plinth_cpu.native import NativeKernels


class CpuOps(SmallOps):
    """:class:`SmallOps` with one native call per op where the operands are fp32 (else torch's).

    Each torch default is several kernels over the activations (RMSNorm: square, mean, rsqrt,
    two multiplies); at decode sizes their dispatch costs more than the arithmetic. The backend
    registers it only where the native kernels load (else plain :class:`SmallOps`); the checks left
    in each op are of its operands (dtype, shape, strides), which the native calls need.
    """

    def __init__(self, native: NativeKernels) -> None:
        self.native = native

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim: ``x / rms(x) * weight``."""
        if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % 8:
            return super().rms_norm(x, weight, eps)
        return self.native.rms_norm(x.contiguous(), weight.contiguous(), eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` in place, then ``(RMSNorm(residual), residual)``, in one native pass."""
        if (
            x.dtype != torch.float32
            or residual.dtype != torch.float32
            or weight.dtype != torch.float32
            or x.dim() != 2
            or x.shape != residual.shape
            or x.shape[1] % 8
            or not residual.is_contiguous()
        ):
            return super().add_rms_norm(x, residual, weight, eps)
        return self.native.rms_norm(x.contiguous(), weight.contiguous(), eps, residual=residual), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, 2I] -> silu(x[:, :I]) * x[:, I:]."""
        if x.dtype != torch.float32 or x.dim() != 2:
            return super().silu_and_mul(x)
        return self.native.silu_and_mul(x.contiguous())

    def rotary(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
        """NeoX rotary of ``x`` [T, H, D] at ``positions`` [T] (a new tensor; ``x`` is not modified)."""
        if (
            x.dtype != torch.float32
            or cos_sin.dtype != torch.float32
            or positions.dtype != torch.int64
            or x.dim() != 3
            or x.stride(2) != 1
            or x.stride(1) != x.shape[2]
            or rotary_dim % 2
        ):
            return super().rotary(x, positions, cos_sin, rotary_dim)
        return self.native.rotary(x, positions.contiguous(), cos_sin.contiguous(), rotary_dim)
