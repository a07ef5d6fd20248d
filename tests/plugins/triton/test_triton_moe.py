"""The Triton fused MoE (grouped GEMM over slots sorted by expert) against the reference op, in the
interpreter. Shapes stay small: the interpreter runs each program in numpy (a 64-expert top-8 call
over 33 tokens takes about 1 s here)."""

from __future__ import annotations

import pytest
import torch

from plinth.platform.backend import MoESpec, NotSupported
from plinth.platform.reference import ReferenceMoE

pytestmark = pytest.mark.triton_interpret


def _moe(spec: MoESpec):  # noqa: ANN202
    from plinth_triton.ops import InterpreterTarget, TritonMoE

    return TritonMoE(spec, torch.device("cpu"), InterpreterTarget())


def _data(spec: MoESpec, t: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    e, h, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
    gate_up = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    down = torch.randn(e, h, i, generator=gen) / i**0.5
    return gate_up, down, torch.randn(t, h, generator=gen), torch.randn(t, e, generator=gen)


def _reference(spec: MoESpec, gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, logits: torch.Tensor):  # noqa: ANN202
    ref = ReferenceMoE(spec)
    return ref.forward(x, logits, ref.prepare(gate_up, down))


@pytest.mark.parametrize(
    "e,k,t,renorm,act",
    [
        (8, 2, 37, True, "silu"),
        (8, 2, 1, True, "silu"),
        (64, 8, 9, True, "silu"),
        (1, 1, 5, True, "gelu_tanh"),
        (8, 8, 3, False, "gelu_tanh"),
        (64, 2, 33, False, "silu"),
    ],
)
def test_matches_the_reference_op_fp32(e: int, k: int, t: int, renorm: bool, act: str) -> None:
    """Unaligned H and I (72, 40), groups of every size including empty ones, both activations."""
    spec = MoESpec(e, k, 72, 40, renormalize=renorm, activation=act)
    gate_up, down, x, logits = _data(spec, t)
    moe = _moe(spec)
    out = moe.forward(x, logits, moe.prepare(gate_up, down))
    torch.testing.assert_close(out, _reference(spec, gate_up, down, x, logits), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_half_precision(dtype: torch.dtype, tol: float) -> None:
    spec = MoESpec(8, 2, 64, 32, dtype=str(dtype).removeprefix("torch."))
    gate_up, down, x, logits = _data(spec, 21, seed=1)
    gate_up, down, x = gate_up.to(dtype), down.to(dtype), x.to(dtype)
    moe = _moe(spec)
    out = moe.forward(x, logits, moe.prepare(gate_up, down))
    assert out.dtype == dtype
    want = _reference(
        MoESpec(8, 2, 64, 32), gate_up.float(), down.float(), x.float(), logits
    )  # fp32 from the same inputs
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


def test_strided_x_and_a_repeat_give_the_same_bits() -> None:
    spec = MoESpec(8, 2, 64, 32)
    gate_up, down, x, logits = _data(spec, 19, seed=2)
    moe = _moe(spec)
    weights = moe.prepare(gate_up, down)
    buf = torch.full((21, 80), float("nan"))
    buf[1:20, 8:72] = x
    first = moe.forward(buf[1:20, 8:72], logits, weights)
    assert torch.equal(first, moe.forward(x, logits, weights))
    torch.testing.assert_close(first, _reference(spec, gate_up, down, x, logits), rtol=1e-5, atol=1e-5)


def test_align_by_expert_pads_each_group_to_the_block() -> None:
    """Every slot appears once, each block holds one expert's slots, padding is the sentinel."""
    from plinth_triton.kernels.moe import align_by_expert

    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 2], [1, 3]])  # expert 3: 5 slots, expert 0: 2, ...
    sorted_ids, block_expert, total = align_by_expert(ids, 5, 4)
    slots = ids.numel()
    assert int(total) == 4 + 4 + 4 + 8  # experts 0, 1, 2 one block each, expert 3 two; expert 4 none
    used = sorted_ids[: int(total)]
    assert sorted(used[used < slots].tolist()) == list(range(slots))
    assert bool((sorted_ids[int(total) :] == slots).all())
    flat = ids.flatten()
    for b in range(int(total) // 4):
        block = sorted_ids[4 * b : 4 * b + 4]
        real = block[block < slots]
        assert real.numel() > 0 and bool((flat[real] == block_expert[b]).all())
    assert block_expert[: int(total) // 4].tolist() == [0, 1, 2, 3, 3]


def test_backend_declares_the_op_and_refuses_quantized_experts() -> None:
    from plinth_cuda.backend import CudaBackend
    from plinth_triton.ops import TritonMoE

    backend = CudaBackend()
    caps = backend.capabilities().fused_moe
    assert caps is not None and caps.dtypes == {"float32", "bfloat16", "float16"} and not caps.quant_formats
    assert isinstance(backend.moe_kernels(MoESpec(8, 2, 64, 32)), TritonMoE)
    with pytest.raises(NotSupported, match="q8_0"):
        backend.moe_kernels(MoESpec(8, 2, 64, 32, quant_format="q8_0"))
    with pytest.raises(NotSupported, match="float64"):
        backend.moe_kernels(MoESpec(8, 2, 64, 32, dtype="float64"))
