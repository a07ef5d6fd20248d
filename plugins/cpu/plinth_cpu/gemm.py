"""Dense GEMM for the CPU backend.

The weight stays ``[N, K]`` row-major and goes through ``F.linear``: oneDNN/MKL then read the right
operand transposed, which is the layout they are fast for. A row-major ``[K, N]`` right operand in
bf16 is ~100x slower on AVX2 hosts, so the weight is never pre-transposed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plinth.platform.backend import GemmKernels, LinearWeight


class CpuGemm(GemmKernels):
    """``x @ w.T + b`` with ``torch.nn.functional.linear`` in one compute dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearWeight:
        """Cast ``weight`` [N, K] (and ``bias`` [N]) to the compute dtype, contiguous, on the CPU."""
        w = weight.to(device="cpu", dtype=self.dtype).contiguous()  # [N, K]
        b = None if bias is None else bias.to(device="cpu", dtype=self.dtype).contiguous()  # [N]
        return LinearWeight(out_features=w.shape[0], in_features=w.shape[1], weight=w, bias=b)

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        """``x`` [M, K] -> [M, N]."""
        if weight.weight is None:
            raise ValueError(f"CpuGemm got a {weight.format!r} weight without a dense tensor")
        return F.linear(x, weight.weight, weight.bias)
