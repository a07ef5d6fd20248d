"""The TPU backend's jnp GEMMs against a float64 numpy oracle, and the DLPack crossing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from plinth_tpu.gemm import dense_linear, int8_linear, prepare_dense, prepare_int8, quantize_int8
from plinth_tpu.interop import to_jax, to_torch


def _data(m: int = 7, k: int = 96, n: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)), rng.standard_normal((n, k)) * 0.1, rng.standard_normal(n))


def test_dense_float32_matches_float64_oracle() -> None:
    x, w, b = _data()
    out = dense_linear(jnp.asarray(x, jnp.float32), prepare_dense(jnp.asarray(w), jnp.asarray(b), "float32"))
    assert out.dtype == jnp.float32 and out.shape == (7, 40)
    np.testing.assert_allclose(np.asarray(out), x @ w.T + b, rtol=1e-5, atol=1e-5)


def test_dense_bfloat16_accumulates_in_float32() -> None:
    x, w, b = _data(k=4096, seed=1)
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    out = dense_linear(xb, prepare_dense(wb, None, "bfloat16"))
    assert out.dtype == jnp.bfloat16
    exact = np.asarray(xb, np.float64) @ np.asarray(wb, np.float64).T  # the same rounded inputs
    # f32 accumulation: error ~ one bf16 rounding of the result; a bf16 accumulator over K=4096 is far worse
    np.testing.assert_allclose(np.asarray(out, np.float64), exact, rtol=1e-2, atol=2e-2)


def test_int8_weight_only() -> None:
    x, w, b = _data(seed=2)
    w[3] = 0.0  # an all-zero output channel must not divide by zero
    q, scale = quantize_int8(jnp.asarray(w, jnp.float32))
    assert q.dtype == jnp.int8 and scale.shape == (40,)
    assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) == 127
    np.testing.assert_allclose(
        np.asarray(q, np.float64) * np.asarray(scale)[:, None], w, atol=float(np.asarray(scale).max()) / 2 + 1e-7
    )
    prepared = prepare_int8(jnp.asarray(w), jnp.asarray(b), "float32")
    out = int8_linear(jnp.asarray(x, jnp.float32), prepared)
    dequant = np.asarray(q, np.float64) * np.asarray(scale, np.float64)[:, None]
    np.testing.assert_allclose(np.asarray(out), x @ dequant.T + b, rtol=1e-5, atol=1e-5)  # exact up to f32
    assert np.abs(np.asarray(out) - (x @ w.T + b)).max() < 0.05  # and close to the float weight
    out_bf16 = int8_linear(jnp.asarray(x, jnp.bfloat16), prepare_int8(jnp.asarray(w), jnp.asarray(b), "bfloat16"))
    assert out_bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out_bf16, np.float64), x @ dequant.T + b, rtol=3e-2, atol=3e-2)


def test_int8_convert_sits_inside_the_compiled_gemm() -> None:
    prepared = prepare_int8(jnp.ones((16, 32)), None, "bfloat16")
    hlo = jax.jit(int8_linear).lower(jnp.ones((4, 32), jnp.bfloat16), prepared).as_text()
    assert "s8" in hlo or "i8" in hlo  # the weight enters the program as int8, not pre-widened


def test_gemm_bad_inputs() -> None:
    with pytest.raises(ValueError, match="float16 is not supported"):
        prepare_dense(jnp.ones((4, 4)), None, "float16")
    with pytest.raises(ValueError, match="bias"):
        prepare_int8(jnp.ones((4, 4)), jnp.ones(3), "float32")
    with pytest.raises(ValueError, match="input features"):
        dense_linear(jnp.ones((2, 5)), prepare_dense(jnp.ones((4, 4)), None, "float32"))


def test_contiguous_tensors_cross_without_a_copy() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    a = to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    back = to_torch(a)
    assert back.data_ptr() == t.data_ptr()
    np.testing.assert_array_equal(back.numpy(), t.numpy())
    bf = torch.randn(3, 8).to(torch.bfloat16)
    assert to_jax(bf).dtype == jnp.bfloat16 and to_jax(bf).unsafe_buffer_pointer() == bf.data_ptr()


def test_strided_tensors_are_copied_once_and_correct() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = t.t()  # not contiguous
    a = to_jax(view)
    assert a.unsafe_buffer_pointer() != t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), view.numpy())
    with pytest.raises(TypeError, match="torch.Tensor"):
        to_jax(np.zeros(3))  # type: ignore[arg-type]
