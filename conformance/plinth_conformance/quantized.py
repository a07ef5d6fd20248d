"""Quantized GEMM cases (plugin API 1.1): random ggml blocks and the activation-rounding oracles.

Since suite 1.3 the rounding is modelled exactly (:data:`ACTIVATION_SCHEMES`, :func:`round_activations`):
the golden result is computed from the activations as each known scheme rounds them, and the
backend must match one scheme within the usual calibrated thresholds; the only allowance left is
one quantum on the elements whose scaled value lies within fp32 rounding of a half-way point
(:func:`tie_allowance`: ``x / d`` and ``x * (1 / d)`` may round those either way). The worst-case
allowance below (suite 1.2) is kept for comparison and the self-tests:

The oracle is the fp64 product of the activations with :func:`plinth.platform.quant.dequantize` of the
weight (the reference semantics of the format). A backend may multiply the blocks natively the way
llama.cpp does, rounding each 32-wide block of activations to int8 with scale ``amax / 127`` (its
Q8_1): element ``k`` then moves by at most half a step, ``amax(block of k) / 254``, so an output
element moves by at most

    allowance[i, j] = sum_k |w[j, k]| * amax(x[i, block of k]) / 254

(:func:`activation_rounding_allowance`). The comparison forgives that much per element and gates
what is left with the suite's usual calibrated thresholds (:func:`plinth_conformance.tolerance.compare`).
A backend that does not round activations stays far inside it; one that decodes the blocks wrongly
(the q4_1 minimum ignored, nibbles in the wrong order, a scale misread) does not.
"""

from __future__ import annotations

import math

import torch

from plinth.platform.backend import LinearWeight
from plinth.platform.quant import QUANT_BLOCKS, QuantizedWeight, quantize_q8_0

#: Activations per rounding block, and the half-step divisor of an int8 rounding with scale amax / 127.
ACT_BLOCK = 32
HALF_STEP_DIVISOR = 254.0


def _f16_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp32 [n] -> its fp16 encoding as uint8 [n, 2] (little-endian, as GGUF stores it)."""
    return values.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def random_q4_1(n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    """NaN-free random q4_1 blocks: fp16 scale ``d > 0``, fp16 minimum ``m`` of either sign and
    about the block's range, uniform nibbles; values of typical size ``1 / sqrt(k)``."""
    nb = n * k // ACT_BLOCK
    d = (0.5 + torch.rand(nb, generator=gen)) * (2.0 / (15.0 * math.sqrt(k)))
    m = torch.randn(nb, generator=gen) * 8.0 * d
    q = torch.randint(0, 16, (nb, ACT_BLOCK), generator=gen, dtype=torch.uint8)
    qs = q[:, :16] | (q[:, 16:] << 4)  # weight j < 16 in the low nibble of byte j, j + 16 in its high one
    blocks = torch.cat((_f16_bytes(d), _f16_bytes(m), qs), dim=1)  # [nb, 20]
    return QuantizedWeight("q4_1", n, k, blocks.reshape(n, -1).contiguous())


def random_q8_0(n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    """:func:`plinth.platform.quant.quantize_q8_0` of random weights; one all-zero block (scale 0)."""
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    w[0, ACT_BLOCK : 2 * ACT_BLOCK] = 0.0  # a block whose scale is 0: 0 * q, never 0 / 0
    return quantize_q8_0(w)


def random_weight(fmt: str, n: int, k: int, gen: torch.Generator) -> QuantizedWeight:
    """A random ``[n, k]`` weight in block format ``fmt``."""
    if fmt == "q4_1":
        return random_q4_1(n, k, gen)
    if fmt == "q8_0":
        return random_q8_0(n, k, gen)
    raise ValueError(f"no generator for quantized format {fmt!r}")


def random_activations(m: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``x`` [m, k] in ``dtype``: normal values, an all-zero 32-block in row 0 (its int8 scale is
    0: dividing by it gives NaN) and an outlier block in the last row (it dominates its block's
    rounding, as outlier features do in real models)."""
    x = torch.randn(m, k, generator=gen)
    x[0, ACT_BLOCK : 2 * ACT_BLOCK] = 0.0
    x[-1, :ACT_BLOCK] *= 50.0
    return x.to(dtype)


def activation_rounding_allowance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[M, N]`` fp64: ``sum_k |w[j, k]| * amax(x[i, block of k]) / 254`` for ``x`` [M, K], ``w`` [N, K]."""
    m, k = x.shape
    n = w.shape[0]
    half_step = x.double().reshape(m, k // ACT_BLOCK, ACT_BLOCK).abs().amax(-1) / HALF_STEP_DIVISOR  # [M, K/32]
    w_abs = w.double().abs().reshape(n, k // ACT_BLOCK, ACT_BLOCK).sum(-1)  # [N, K/32]
    return half_step @ w_abs.t()


#: Activation roundings the oracle models: name -> (levels of the int grid, scale stored as fp16,
#: q4_1's minimum term multiplies the exact sum of the block's activations rather than the rounded).
#: "none": the activations as given; "int8": per 32-block, scale ``amax / 127`` in fp32 (plinth's
#: cpu ``int8`` mode); "int8-f16-scale": the same quants with the scale stored in fp16 (ggml's Q8_1);
#: "int16": scale ``amax / 32767`` in fp32 and the exact sum (the cpu backend's default on few rows).
ACTIVATION_SCHEMES: dict[str, tuple[int, bool, bool]] = {
    "none": (0, False, False),
    "int16": (32767, False, True),
    "int8": (127, False, False),
    "int8-f16-scale": (127, True, False),
}
#: How close (relative) to a half-way point ``x / d`` must be for either rounding to be legitimate.
TIE_WINDOW = 4 * float(torch.finfo(torch.float32).eps)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    return x.float().reshape(m, k // ACT_BLOCK, ACT_BLOCK)


def _scale(x: torch.Tensor, levels: int) -> torch.Tensor:
    """Per-32-block scale ``amax / levels`` in fp32, ``[M, K/32, 1]``."""
    return _blocks(x).abs().amax(-1, keepdim=True) / float(levels)


def round_activations(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """``x`` [M, K] as ``scheme`` rounds it (fp32): ``round(x / d) * d`` per 32-block, ``d`` the
    block's ``amax / levels`` (0 for an all-zero block: its values stay 0)."""
    if scheme not in ACTIVATION_SCHEMES:
        raise ValueError(f"unknown activation rounding {scheme!r}; known: {', '.join(ACTIVATION_SCHEMES)}")
    levels, f16_scale, _ = ACTIVATION_SCHEMES[scheme]
    if levels == 0:
        return x.float()
    xb, d = _blocks(x), _scale(x, levels)
    q = torch.where(d > 0, xb / torch.where(d > 0, d, 1.0), 0.0).round().clamp(-levels, levels)
    if f16_scale:
        d = d.to(torch.float16).float()
    return (q * d).reshape(x.shape)


def tie_allowance(x: torch.Tensor, w: torch.Tensor, scheme: str) -> torch.Tensor:
    """``[M, N]`` fp64: ``sum |w[j, k]| * d(i, block of k)`` over the activations whose ``x / d`` is
    within :data:`TIE_WINDOW` of a half-way point (where fp32 may round up or down); 0 elsewhere."""
    m, k = x.shape
    levels, f16_scale, _ = ACTIVATION_SCHEMES[scheme]
    if levels == 0:
        return torch.zeros(m, w.shape[0], dtype=torch.float64)
    xb, d = _blocks(x).double(), _scale(x, levels).double()
    t = torch.where(d > 0, xb / torch.where(d > 0, d, 1.0), 0.0)
    frac = (t.abs() - t.abs().floor() - 0.5).abs()
    near = (frac <= TIE_WINDOW * t.abs().clamp_min(1.0)).double()  # [M, K/32, 32]
    if f16_scale:
        d = d.to(torch.float16).double()
    return (near * d).reshape(m, k) @ w.double().abs().t()


def minimums(weight: QuantizedWeight) -> torch.Tensor:
    """``[N, K]`` fp32: q4_1's per-block minimum ``m`` at every weight (0 for formats without one)."""
    if weight.format != "q4_1":
        return torch.zeros(weight.out_features, weight.in_features)
    _, nbytes = QUANT_BLOCKS[weight.format]
    blocks = weight.blocks.reshape(-1, nbytes)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()  # [n_blocks, 1]
    return m.expand(-1, ACT_BLOCK).reshape(weight.out_features, weight.in_features)


def rounded_weight(w: torch.Tensor, mins: torch.Tensor, scheme: str) -> torch.Tensor:
    """The weight the *rounded* activations multiply under ``scheme``: ``w - m`` where the scheme keeps
    the exact sum for q4_1's minimum, else ``w`` (what a tie's one quantum is scaled by)."""
    return w - mins if ACTIVATION_SCHEMES[scheme][2] and bool(mins.any()) else w


def scheme_operands(
    x: torch.Tensor, w: torch.Tensor, mins: torch.Tensor, scheme: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The products whose sum is the backend's result under ``scheme``: ``[(x_rounded, w)]``, or
    for a scheme that keeps the exact sum for q4_1's minimum, ``[(x_rounded, w - m), (x, m)]``."""
    xr = round_activations(x, scheme)
    if ACTIVATION_SCHEMES[scheme][2] and bool(mins.any()):
        return [(xr, rounded_weight(w, mins, scheme)), (x.float(), mins)]
    return [(xr, w)]


def prepared_bytes(weight: LinearWeight) -> int:
    """Bytes of the tensors a prepared weight holds besides its bias (each storage counted once)."""
    seen: dict[tuple[str, int], int] = {}

    def visit(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            seen[(str(obj.device), storage.data_ptr())] = storage.nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                visit(v)

    visit(weight.weight)
    visit(weight.data)
    return sum(seen.values())


def blocks_bytes(weight: QuantizedWeight) -> int:
    """Bytes of the weight's GGUF blocks."""
    _, nbytes = QUANT_BLOCKS[weight.format]
    return weight.out_features * weight.in_features // ACT_BLOCK * nbytes
