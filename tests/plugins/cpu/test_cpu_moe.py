"""CpuMoE: the fused MoE grouped by expert, against the reference op; one GEMM pair per expert group."""

from __future__ import annotations

import pytest
import torch

from plinth.platform.backend import GemmKernels, LinearWeight, MoESpec, NotSupported
from plinth.platform.quant import quantize_q8_0
from plinth.platform.reference import ReferenceMoE
from plinth_cpu import CpuBackend
from plinth_cpu.moe import CpuMoE
from plinth_cpu.native import native

needs_native = pytest.mark.skipif(native() is None, reason="the native kernels are not built on this host")


def _experts(spec: MoESpec, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    return torch.randn(e, 2 * i, h, generator=gen) / h**0.5, torch.randn(e, h, i, generator=gen) / i**0.5


def _inputs(spec: MoESpec, t: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, spec.hidden_size, generator=gen), torch.randn(t, spec.num_experts, generator=gen)


class _CountingGemm(GemmKernels):
    """The backend's GEMM, counting ``linear`` calls and the rows they multiply."""

    def __init__(self, inner: GemmKernels) -> None:
        self.inner = inner
        self.calls = 0
        self.rows = 0

    def prepare(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearWeight:
        return self.inner.prepare(weight, bias)

    def linear(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        self.calls += 1
        self.rows += x.shape[0]
        return self.inner.linear(x, weight)


@pytest.mark.parametrize(
    "dtype,act,tol",
    [
        ("float32", "silu", 1e-5),
        ("float32", "gelu_tanh", 1e-5),
        ("bfloat16", "silu", 2e-2),
        ("float64", "gelu_tanh", 1e-12),
    ],
)
@pytest.mark.parametrize("e,k,t", [(8, 2, 37), (64, 8, 5), (1, 1, 3), (8, 8, 1)])
def test_matches_the_reference_op(dtype: str, act: str, tol: float, e: int, k: int, t: int) -> None:
    spec = MoESpec(e, k, 64, 40, dtype=dtype, activation=act)
    gate_up, down = _experts(spec)
    x, logits = _inputs(spec, t)
    dt = getattr(torch, dtype)
    x = x.to(dt)
    moe = CpuBackend().moe_kernels(spec)
    out = moe.forward(x, logits, moe.prepare(gate_up.to(dt), down.to(dt)))
    ref = ReferenceMoE(spec)
    want = ref.forward(x, logits, ref.prepare(gate_up.to(dt), down.to(dt)))
    assert out.dtype == dt and out.shape == (t, 64)
    torch.testing.assert_close(out.double(), want.double(), rtol=tol, atol=tol)


def test_each_expert_group_is_one_gemm_pair_and_idle_experts_cost_nothing() -> None:
    """64 tokens over 8 experts: 2 GEMM calls per expert with tokens (not 2 per token and choice)."""
    spec = MoESpec(8, 2, 64, 32, renormalize=False)
    backend = CpuBackend()
    gemm = _CountingGemm(backend.gemm_kernels("float32"))
    moe = CpuMoE(spec, gemm, backend.small_ops())
    weights = moe.prepare(*_experts(spec))
    x, logits = _inputs(spec, 64)
    logits[:, 5:] = -1e4  # experts 5, 6, 7 get no tokens
    out = moe.forward(x, logits, weights)
    assert gemm.calls == 2 * 5 and gemm.rows == 2 * 64 * 2
    ref = ReferenceMoE(spec)
    torch.testing.assert_close(out, ref.forward(x, logits, ref.prepare(*_experts(spec))), rtol=1e-5, atol=1e-5)


def test_strided_inputs_and_a_repeat_give_the_same_bits() -> None:
    spec = MoESpec(8, 2, 64, 32)
    moe = CpuBackend().moe_kernels(spec)
    weights = moe.prepare(*_experts(spec))
    x, logits = _inputs(spec, 70)
    buf = torch.full((72, 80), float("nan"))
    buf[1:71, 8:72] = x
    first = moe.forward(buf[1:71, 8:72], logits, weights)
    assert torch.equal(first, moe.forward(x, logits, weights))
    assert torch.equal(first, moe.forward(x, logits, weights))
    assert torch.isfinite(first).all()


@needs_native
@pytest.mark.parametrize("t", [1, 5, 40, 200])
def test_quantized_experts_keep_their_blocks(t: int) -> None:
    """q8_0 experts are kept as blocks (never dequantized at load; the AVX-512 build lays them out in its
    16-row panels) and match the dequantized op."""
    spec = MoESpec(8, 2, 128, 64, quant_format="q8_0")
    gate_up, down = _experts(spec)
    gu = [quantize_q8_0(w) for w in gate_up]
    dn = [quantize_q8_0(w) for w in down]
    moe = CpuBackend().moe_kernels(spec)
    weights = moe.prepare_quantized(gu, dn)
    layout = getattr(moe.gemm, "q8_0_layout", None)  # the native builds: 16-row panels (q8_0p16), packed at load
    assert weights.format == (layout or "q8_0") and weights.gate_up is None
    if layout is None:
        assert weights.data["gate_up"][3].data["blocks"].data_ptr() == gu[3].blocks.data_ptr()  # the blocks themselves
    x, logits = _inputs(spec, t)
    ref = ReferenceMoE(spec)
    want = ref.forward(x, logits, ref.prepare_quantized(gu, dn))
    out = moe.forward(x, logits, weights)
    assert float((out - want).norm() / want.norm()) < 1e-4  # int16-rounded activations on few rows


def test_declares_the_op_and_refuses_what_it_does_not() -> None:
    backend = CpuBackend()
    assert backend.api_version == (1, 16)
    caps = backend.capabilities().fused_moe
    assert caps is not None and {"float32", "bfloat16"} <= caps.dtypes and caps.activations == {"silu", "gelu_tanh"}
    with pytest.raises(NotSupported, match="q5_k"):
        backend.moe_kernels(MoESpec(8, 2, 64, 32, quant_format="q5_k"))


def test_bad_shapes_name_what_was_wrong() -> None:
    spec = MoESpec(8, 2, 64, 32)
    moe = CpuBackend().moe_kernels(spec)
    gate_up, down = _experts(spec)
    with pytest.raises(ValueError, match=r"gate_up \(8, 64, 64\).*expected \(8, 64, 64\) / \(8, 64, 32\)"):
        moe.prepare(gate_up, down[:, :, :16])
    weights = moe.prepare(gate_up, down)
    with pytest.raises(ValueError, match=r"router_logits \(3, 4\): expected \[3, 8\]"):
        moe.forward(torch.randn(3, 64), torch.randn(3, 4), weights)
    with pytest.raises(ValueError, match=r"x \(3, 65\): expected \[T, 64\]"):
        moe.forward(torch.randn(3, 65), torch.randn(3, 8), weights)


def test_layers_share_one_set_of_work_buffers_and_results_are_not_aliased() -> None:
    """Two MoE layers from one backend reuse the same scratch; a result survives the next call."""
    backend = CpuBackend()
    spec = MoESpec(8, 2, 64, 32)
    first, second = backend.moe_kernels(spec), backend.moe_kernels(spec)
    w1, w2 = first.prepare(*_experts(spec, 0)), second.prepare(*_experts(spec, 1))
    x, logits = _inputs(spec, 40)
    out1 = first.forward(x, logits, w1)
    kept = out1.clone()
    second.forward(x, logits, w2)
    assert torch.equal(out1, kept)
    assert isinstance(first, CpuMoE) and isinstance(second, CpuMoE) and first.scratch is second.scratch
