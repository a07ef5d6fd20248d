"""The cpu backend's batched LoRA op equals the reference op: contiguous runs (slices) and scattered
adapters (gather/scatter-add), column slices of fused outputs, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from plinth.platform.reference import ReferenceLoRA
from plinth.platform.values import LoRASpec
from plinth_cpu.backend import CpuBackend
from plinth_cpu.lora import CpuLoRA, _runs

CPU = torch.device("cpu")
SLOTS = {
    "one adapter": [1] * 9,
    "runs": [0, 0, 0, -1, -1, 2, 2, 2, 2],  # prefill chunks: one run per adapter (slices)
    "scattered": [0, 2, -1, 0, 2, 1, 0, -1, 2],  # a mixed decode batch (gathers)
    "none but one": [-1, -1, -1, -1, 3, -1, -1, -1, -1],
}


def test_runs_group_consecutive_equal_slots() -> None:
    assert _runs([0, 0, -1, 2, 2, 2, 0]) == [(0, 0, 2), (2, 3, 6), (0, 6, 7)]
    assert _runs([-1, -1]) == []


@pytest.mark.parametrize("case", list(SLOTS))
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_lora_equals_reference(case: str, dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    slots = SLOTS[case]
    spec = LoRASpec(max_loras=4, max_rank=8, dtype="float32" if dtype == torch.float32 else "bfloat16")
    x = torch.randn(len(slots), 24, dtype=dtype)
    a = torch.randn(4, 2 * 8, 24, dtype=dtype)  # two fused modules' A, one shrink
    b = torch.randn(4, 10, 8, dtype=dtype)
    outs = []
    for op in (ReferenceLoRA(spec), CpuLoRA(spec)):
        y = torch.ones(len(slots), 30, dtype=dtype)
        batch = op.prepare_batch(slots, CPU)
        s = op.shrink(x, a, batch)
        op.expand(y[:, 10:20], s[:, 8:16], b, batch)  # the second module: a column slice both ways
        outs.append(y)
    ref, fast = outs
    torch.testing.assert_close(fast.float(), ref.float(), atol=tol * 10, rtol=tol)
    untouched = [t for t, slot in enumerate(slots) if slot < 0]
    assert bool((fast[untouched] == 1).all()) and bool((fast[:, :10] == 1).all())


def test_backend_hands_out_the_cpu_op() -> None:
    op = CpuBackend().lora_kernels(LoRASpec(max_loras=2, max_rank=16))
    assert isinstance(op, CpuLoRA)
