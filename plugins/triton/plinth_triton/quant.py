"""Weight-only quantization formats of the Triton GEMM (plain torch: runs once, at load time).

* ``int8``: symmetric, one fp32 scale per output channel: ``w ~ q * scale[n]``, q in [-127, 127].
* ``int4``: symmetric, one fp32 scale per ``group_size`` inputs of a channel: q in [-8, 7], two
  per byte (even k in the low nibble), stored as ``q + 8``.

:func:`dequantize` is the oracle the kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: ``LinearWeight.format`` -> the GEMM kernel's ``QUANT`` code.
QUANT_CODES = {"dense": 0, "int8": 1, "int4": 2}


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A quantized ``[N, K]`` weight: int8 ``[N, K]`` or packed uint8 ``[N, ceil(K/2)]``, and fp32 scales."""

    fmt: str
    qweight: torch.Tensor
    scale: torch.Tensor  # [N] (int8) or [N, ceil(K / group_size)] (int4)
    group_size: int
    in_features: int


def quantize(weight: torch.Tensor, fmt: str, group_size: int = 32) -> QuantizedWeight:
    """Quantize ``weight`` [N, K] (any float dtype) to ``fmt``."""
    w = weight.float()
    n, k = w.shape
    if fmt == "int8":
        scale = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)  # [N]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(fmt, q.contiguous(), scale.contiguous(), 1, k)
    if fmt == "int4":
        groups = -(-k // group_size)
        padded = torch.nn.functional.pad(w, (0, groups * group_size - k)).view(n, groups, group_size)
        scale = (padded.abs().amax(dim=2) / 7).clamp_min(1e-12)  # [N, G]
        q = torch.round(padded / scale[:, :, None]).clamp(-8, 7).view(n, -1)[:, :k]  # [N, K]
        q = torch.nn.functional.pad(q + 8, (0, k % 2)).to(torch.uint8)  # even length: whole bytes
        packed = q[:, 0::2] | (q[:, 1::2] << 4)  # [N, ceil(K/2)]
        return QuantizedWeight(fmt, packed.contiguous(), scale.contiguous(), group_size, k)
    raise ValueError(f"unknown weight format {fmt!r}; known: int8, int4")


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The fp32 ``[N, K]`` weight that ``qw`` stands for."""
    if qw.fmt == "int8":
        return qw.qweight.float() * qw.scale[:, None]
    low = (qw.qweight & 0xF).to(torch.int16) - 8
    high = (qw.qweight >> 4).to(torch.int16) - 8
    q = torch.stack((low, high), dim=-1).view(qw.qweight.shape[0], -1)[:, : qw.in_features]  # [N, K]
    scale = qw.scale.repeat_interleave(qw.group_size, dim=1)[:, : qw.in_features]
    return q.float() * scale
