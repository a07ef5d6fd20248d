"""The Triton GEMM against torch, in the interpreter: unaligned shapes, strided inputs, dtypes,
and weight-only int8 / int4 against the dequantized weight."""

from __future__ import annotations

import pytest
import torch

from plinth.platform.backend import GemmKernels

pytestmark = pytest.mark.triton_interpret


def _gemm(dtype: torch.dtype) -> GemmKernels:
    from plinth_triton.ops import InterpreterTarget, TritonGemm

    return TritonGemm(dtype, torch.device("cpu"), InterpreterTarget())


def _data(m: int, k: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5, torch.randn(n, generator=gen)


@pytest.mark.parametrize("m", [1, 33])
def test_unaligned_fp32(m: int) -> None:
    """M, N, K off every tile multiple (33 x 255 x 513 and a decode row), with and without bias."""
    x, w, b = _data(m, 255, 513)
    gemm = _gemm(torch.float32)
    x_before = x.clone()
    torch.testing.assert_close(gemm.linear(x, gemm.prepare(w, b)), x @ w.T + b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemm.linear(x, gemm.prepare(w, None)), x @ w.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(x, x_before)


def test_strided_operands() -> None:
    """A transposed activation, a view with a wider row stride, a column-major weight."""
    x, w, b = _data(20, 72, 40, seed=1)
    gemm = _gemm(torch.float32)
    weight = gemm.prepare(w.T.contiguous().T, b)
    want = x @ w.T + b
    torch.testing.assert_close(gemm.linear(x.T.contiguous().T, weight), want, rtol=1e-5, atol=1e-5)
    wide = torch.full((20, 100), float("nan"))
    wide[:, 10:82] = x
    torch.testing.assert_close(gemm.linear(wide[:, 10:82], weight), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_precision(dtype: torch.dtype, tol: float) -> None:
    """bf16/fp16 operands, fp32 accumulation, one rounding on store."""
    x, w, b = _data(17, 130, 70, seed=2)
    gemm = _gemm(dtype)
    out = gemm.linear(x.to(dtype), gemm.prepare(w, b))
    assert out.dtype == dtype
    want = x.to(dtype).float() @ w.to(dtype).float().T + b.to(dtype).float()
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("fmt,k,group", [("int8", 255, 1), ("int4", 255, 32), ("int4", 96, 64)])
def test_weight_only_quantized(fmt: str, k: int, group: int) -> None:
    """int8 per channel and int4 with group scales (odd K, a partial group) vs the dequantized weight."""
    from plinth_triton.quant import dequantize, quantize

    x, w, b = _data(9, k, 50, seed=3)
    gemm = _gemm(torch.float32)
    weight = gemm.prepare_quantized(w, b, fmt, group_size=group)
    assert weight.format == fmt and weight.weight is None
    w_deq = dequantize(quantize(w, fmt, group))
    torch.testing.assert_close(gemm.linear(x, weight), x @ w_deq.T + b, rtol=1e-5, atol=1e-5)
    # The quantization itself is close to the weight (4 / 8 bits of a symmetric range).
    assert (w_deq - w).abs().max() <= w.abs().max() / (7 if fmt == "int4" else 127)


def test_quantize_rejects_unknown_format() -> None:
    """A typo in a format name is an error, not a dense fallback."""
    from plinth_triton.quant import quantize

    with pytest.raises(ValueError, match="int8, int4"):
        quantize(torch.randn(4, 4), "int3")
