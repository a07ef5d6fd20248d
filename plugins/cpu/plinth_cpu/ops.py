"""Norm, activation and rotary ops for the CPU backend: native kernels for fp32, bf16 and fp16
activations (16-bit values widened exactly, computed in fp32, each result rounded once), torch
otherwise."""

from __future__ import annotations

import torch

from plinth.platform.backend import SmallOps
from plinth_cpu.native import ELEMENT_TYPES, NativeKernels


class TorchOps(SmallOps):
    """The backend's ops without native kernels: torch's defaults, and the sliced argmax."""

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(dim=-1)`` of a 2-D tensor, the same indices: :func:`sliced_argmax`."""
        return sliced_argmax(x)


class CpuOps(TorchOps):
    """:class:`TorchOps` with one native call per op where the operands are fp32, bf16 or fp16 (of
    one dtype; else torch's).

    Each torch default is several kernels over the activations (RMSNorm: square, mean, rsqrt,
    two multiplies); at decode sizes their dispatch costs more than the arithmetic. The backend
    registers it only where the native kernels load (else :class:`TorchOps`); the checks left in
    each op are of its operands (dtype, shape, strides), which the native calls need.
    """

    def __init__(self, native: NativeKernels) -> None:
        self.native = native

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(dim=-1)`` of a 2-D tensor: one native pass for the maximum and one for its first
        index per row (fp32 rows of unit stride, on the CPU), else :func:`sliced_argmax`. Greedy
        sampling's step at batch 1: torch's argmax over a 49,152-token vocabulary took ~100 us of a
        ~4 ms token here (AMD EPYC Zen 4, SmolLM2-135M Q4_1), the native one ~10."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1 or x.device.type != "cpu":
            return super().argmax(x)
        return self.native.argmax_rows(x)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim: ``x / rms(x) * weight``."""
        if x.dtype not in ELEMENT_TYPES or weight.dtype != x.dtype or x.dim() != 2 or x.shape[1] % 8:
            return super().rms_norm(x, weight, eps)
        return self.native.rms_norm(x.contiguous(), weight.contiguous(), eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` in place, then ``(RMSNorm(residual), residual)``, in one native pass."""
        if (
            x.dtype not in ELEMENT_TYPES
            or residual.dtype != x.dtype
            or weight.dtype != x.dtype
            or x.dim() != 2
            or x.shape != residual.shape
            or x.shape[1] % 8
            or not residual.is_contiguous()
        ):
            return super().add_rms_norm(x, residual, weight, eps)
        return self.native.rms_norm(x.contiguous(), weight.contiguous(), eps, residual=residual), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, 2I] -> silu(x[:, :I]) * x[:, I:]."""
        if x.dtype not in ELEMENT_TYPES or x.dim() != 2:
            return super().silu_and_mul(x)
        return self.native.silu_and_mul(x.contiguous())

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [M, 2I] -> gelu_tanh(x[:, :I]) * x[:, I:] (Gemma 3's MLP) in one native pass."""
        if x.dtype not in ELEMENT_TYPES or x.dim() != 2:
            return super().gelu_tanh_and_mul(x)
        return self.native.gelu_tanh_and_mul(x.contiguous())

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """The forbidden tokens' logits set to -inf in one native pass on the calling thread (torch's
        default is four elementwise kernels over [S, V], each a parallel region on the pool)."""
        if (
            logits.dtype != torch.float32
            or logits.dim() != 2
            or logits.stride(1) != 1
            or bitmask.dtype != torch.int32
            or bitmask.dim() != 2
            or bitmask.shape[0] != logits.shape[0]
            or bitmask.shape[1] * 32 < logits.shape[1]
        ):
            return super().apply_token_bitmask(logits, bitmask)
        self.native.apply_token_bitmask(logits, bitmask.contiguous())

    def rms_norm_heads(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each head of ``x`` [T, H, D] read in place from the strided view of the fused
        QKV (torch's default copies it dense first, which keeps a decode step out of a step graph)."""
        if (
            x.dtype not in ELEMENT_TYPES
            or weight.dtype != x.dtype
            or x.dim() != 3
            or x.stride(2) != 1
            or x.stride(1) != x.shape[2]
            or x.shape[2] % 8
        ):
            return super().rms_norm_heads(x, weight, eps)
        return self.native.rms_norm_heads(x, weight.contiguous(), eps)

    def rotary(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
        """NeoX rotary of ``x`` [T, H, D] at ``positions`` [T] (a new tensor; ``x`` is not modified)."""
        if (
            x.dtype not in ELEMENT_TYPES
            or cos_sin.dtype != torch.float32
            or positions.dtype != torch.int64
            or x.dim() != 3
            or x.stride(2) != 1
            or x.stride(1) != x.shape[2]
            or rotary_dim % 2
        ):
            return super().rotary(x, positions, cos_sin, rotary_dim)
        return self.native.rotary(x, positions.contiguous(), cos_sin.contiguous(), rotary_dim)


#: Vocabulary slice of :func:`sliced_argmax`; rows shorter than ``4 * ARGMAX_CHUNK`` take one argmax.
ARGMAX_CHUNK = 1024


def sliced_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor (the first index of each row's maximum; a NaN counts as the
    maximum, as in torch), in two passes: the maximum of each ``ARGMAX_CHUNK``-wide slice, then one
    argmax inside the first slice that holds the row's maximum.

    torch's CPU argmax runs at about a tenth of the speed of its max-reduction (64 rows of a 49,152-token
    vocabulary: 3.9 ms against 0.6 ms this way, 2 threads; a 64-sequence decode step of SmolLM2 Q4_1
    200 -> 190 ms). A single row takes torch's argmax: it runs on the calling thread, where the slices'
    maxima would wake torch's worker threads, which then spin against this backend's own pool (batch 1:
    +2.2 ms a token).
    """
    rows, width = x.shape
    c = ARGMAX_CHUNK
    if rows < 2 or width < 4 * c:
        return x.argmax(dim=-1)
    n = width // c
    slice_max = x[:, : n * c].reshape(rows, n, c).amax(dim=-1)  # [S, n]
    if width > n * c:  # the short last slice
        slice_max = torch.cat([slice_max, x[:, n * c :].amax(dim=-1, keepdim=True)], dim=1)
    first = slice_max.argmax(dim=-1)  # [S]: the first slice holding the maximum (or a NaN)
    # a window of c ending at the row's end for the short slice: what it overlaps of the slice before
    # holds no maximum (that slice is not the first to hold one)
    start = torch.clamp(first * c, max=width - c)
    window = x.gather(1, start[:, None] + torch.arange(c, device=x.device))  # [S, c]
    return start + window.argmax(dim=-1)
