"""Quantized weights the core can carry from a checkpoint to a backend without dequantizing them.

A :class:`QuantizedWeight` is a ``[N, K]`` linear weight stored in one of ggml's block formats,
bit for bit as a GGUF file holds it (row after row, ``K / 32`` blocks per row). Backends that
declare the format in ``Capabilities.quant_formats`` get it through
:meth:`~plinth.platform.backend.GemmKernels.prepare_quantized`; for every other backend the core
dequantizes it with :func:`dequantize` (plain torch, the reference semantics) at load time.

Formats (32 weights per block):

* ``q8_0``: ``{fp16 d; int8 q[32]}``, value ``d * q`` (34 bytes). Also what ``quantization="int8"``
  makes of a floating-point checkpoint: :func:`quantize_q8_0`.
* ``q4_1``: ``{fp16 d; fp16 m; uint8 qs[16]}``, value ``d * q + m`` with ``q`` in 0..15; weight
  ``j < 16`` is the low nibble of ``qs[j]``, weight ``j + 16`` its high nibble (20 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plinth.platform.devices import HOST

#: Block format -> (weights per block, bytes per block).
QUANT_BLOCKS: dict[str, tuple[int, int]] = {"q8_0": (32, 34), "q4_1": (32, 20)}


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A ``[out_features, in_features]`` weight in a block format: ``blocks`` is uint8 ``[N, K / 32 * bytes]``.

    .. versionadded:: 1.1
    """

    format: str
    out_features: int
    in_features: int
    blocks: torch.Tensor

    def __post_init__(self) -> None:
        if self.format not in QUANT_BLOCKS:
            raise ValueError(f"unknown quantized format {self.format!r}; known: {', '.join(sorted(QUANT_BLOCKS))}")
        per_block, nbytes = QUANT_BLOCKS[self.format]
        if self.in_features % per_block:
            raise ValueError(f"{self.format} needs in_features divisible by {per_block}, got {self.in_features}")
        expected = (self.out_features, self.in_features // per_block * nbytes)
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != expected:
            raise ValueError(
                f"{self.format} blocks must be uint8 {expected}, got {self.blocks.dtype} {tuple(self.blocks.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """``(out_features, in_features)``, like the dense tensor it stands for."""
        return (self.out_features, self.in_features)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The weight with its rows reordered/selected by ``index`` (blocks never straddle rows)."""
        return QuantizedWeight(self.format, int(index.numel()), self.in_features, self.blocks.index_select(0, index))

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row-wise concatenation (fused q/k/v, gate/up) of weights in one format."""
        fmt, k = parts[0].format, parts[0].in_features
        if any(p.format != fmt or p.in_features != k for p in parts):
            raise ValueError("only weights of one format and width can be concatenated")
        blocks = torch.cat([p.blocks for p in parts], dim=0)
        return QuantizedWeight(fmt, blocks.shape[0], k, blocks)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scalar at byte ``start`` of every block [n, bytes], as fp32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def dequantize_blocks(fmt: str, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks [n_blocks, bytes] of ``fmt`` -> fp32 [n_blocks, 32] (ggml's exact fp32 arithmetic)."""
    if fmt == "q8_0":
        return blocks[:, 2:].view(torch.int8).float() * _f16(blocks, 0)  # int8 bytes read in place
    if fmt == "q4_1":
        qs = blocks[:, 4:]
        nibbles = torch.cat((qs & 0x0F, qs >> 4), dim=1)  # low nibbles are weights 0-15
        return _f16(blocks, 0) * nibbles.float() + _f16(blocks, 2)
    raise ValueError(f"unknown quantized format {fmt!r}")


def dequantize_rows(weight: QuantizedWeight, index: torch.Tensor) -> torch.Tensor:
    """The fp32 rows ``index`` [T] of ``weight`` -> ``[T, K]``, those rows' blocks alone dequantized:
    ``dequantize(weight.rows(index))`` in fewer torch calls (an embedding lookup runs it every decode
    step)."""
    _, nbytes = QUANT_BLOCKS[weight.format]
    blocks = weight.blocks.index_select(0, index).view(-1, nbytes)
    return dequantize_blocks(weight.format, blocks).view(index.numel(), weight.in_features)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The fp32 ``[N, K]`` values of ``weight``.

    .. versionadded:: 1.1
    """
    _, nbytes = QUANT_BLOCKS[weight.format]
    flat = dequantize_blocks(weight.format, weight.blocks.reshape(-1, nbytes))
    return flat.reshape(weight.out_features, weight.in_features)


def quantize_q8_0(weight: torch.Tensor) -> QuantizedWeight:
    """A floating-point ``[N, K]`` weight as q8_0 (int8 per 32 weights, fp16 scale ``amax / 127``).

    Rounds half away from zero like ggml's ``quantize_row_q8_0``, so a GGUF Q8_0 tensor made from
    the same fp32 values holds the same bytes.
    """
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"q8_0 needs in_features divisible by 32, got {k}")
    w = weight.detach().to(HOST, torch.float32).reshape(-1, 32)  # [n_blocks, 32]
    d = w.abs().amax(dim=1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    scaled = w * inv
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).clamp_(-127, 127).to(torch.int8)
    d16 = d.to(torch.float16)
    blocks = torch.cat((d16.view(torch.uint8).reshape(-1, 2), q.view(torch.uint8)), dim=1)  # [n_blocks, 34]
    return QuantizedWeight("q8_0", n, k, blocks.reshape(n, -1).contiguous())
