"""CpuOps.argmax, which the sampler picks greedy tokens with on this backend: the native two-pass
argmax (fp32 rows), else the sliced one."""

from __future__ import annotations

import pytest
import torch

from plinth.platform.backend import SmallOps
from plinth_cpu import CpuBackend
from plinth_cpu.native import native
from plinth_cpu.ops import ARGMAX_CHUNK, CpuOps, TorchOps, sliced_argmax

needs_native = pytest.mark.skipif(native() is None, reason="no native kernels here")


@pytest.mark.parametrize("width", [4 * ARGMAX_CHUNK, 49152, 49153, 5000, 100])
def test_sliced_argmax_matches_torch_argmax(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    x = torch.randn(7, width, generator=g)
    assert torch.equal(sliced_argmax(x), x.argmax(-1))
    ties = torch.randint(0, 3, (7, width), generator=g).float()  # many maxima: the first one wins
    assert torch.equal(sliced_argmax(ties), ties.argmax(-1))
    ties[:3, -1] = 5.0  # the maximum in the short last slice (or the last full one)
    if width > ARGMAX_CHUNK:
        ties[3, ARGMAX_CHUNK - 1] = ties[3, ARGMAX_CHUNK] = 5.0  # across a slice boundary
    ties[4, width // 2] = float("nan")  # a NaN counts as the maximum, as in torch
    assert torch.equal(sliced_argmax(ties), ties.argmax(-1))
    minus_inf = torch.full((2, width), float("-inf"))
    assert torch.equal(sliced_argmax(minus_inf), minus_inf.argmax(-1))
    assert torch.equal(sliced_argmax(x[:1]), x[:1].argmax(-1))  # one row: torch's own argmax


def test_the_backend_offers_it_to_the_sampler() -> None:
    ops = CpuBackend().small_ops()
    assert isinstance(ops, TorchOps) and type(ops).argmax is not SmallOps.argmax  # CpuOps with native kernels
    x = torch.randn(5, 49152, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ops.argmax(x), SmallOps().argmax(x))


@needs_native
@pytest.mark.parametrize("width", [1, 7, 8, 31, 32, 33, 1000, 49152, 49153])
@pytest.mark.parametrize("rows", [1, 5])  # a lone row on the calling thread; rows over the pool
def test_native_argmax_matches_torch_argmax(rows: int, width: int) -> None:
    """The first index of each row's maximum, as torch's argmax: ties go to the first, a NaN counts as
    the maximum (the first NaN), -0 and +0 are equal, a row of -inf gives 0; rows may be a strided
    slice of a wider tensor (the logits of some rows of a batch)."""
    nk = native()
    assert nk is not None
    g = torch.Generator().manual_seed(rows * 100_000 + width)
    wide = torch.randn(rows, width + 3, generator=g)
    x = wide[:, 1 : width + 1]  # row stride width + 3, unit column stride
    assert torch.equal(nk.argmax_rows(x), x.argmax(-1))
    ties = torch.randint(0, 3, (rows, width), generator=g).float()
    ties[0, -1] = 7.0  # the maximum in the row's tail (past the last full vector)
    assert torch.equal(nk.argmax_rows(ties), ties.argmax(-1))
    special = torch.randn(rows, width, generator=g)
    special[0, width // 2] = float("nan")
    special[0, width - 1] = float("nan")
    if rows > 1:
        special[1] = float("-inf")
        special[2] = torch.where(torch.arange(width) % 2 == 0, torch.tensor(-0.0), torch.tensor(0.0)) - 1.0
        special[2, width // 3] = 0.0
        special[2, width // 2] = -0.0  # -0 after +0: the first wins (they compare equal)
        special[3, 0] = float("inf")
    got, want = nk.argmax_rows(special), special.argmax(-1)
    assert torch.equal(got, want), (got, want)


@needs_native
def test_native_ops_take_fp32_rows_and_leave_the_rest_to_torch() -> None:
    """CpuOps.argmax runs natively on fp32 rows of unit column stride; other dtypes and layouts keep
    the sliced argmax, with the same answers."""
    nk = native()
    assert nk is not None
    ops = CpuOps(nk)
    g = torch.Generator().manual_seed(3)
    for x in (torch.randn(3, 5000, generator=g), torch.randn(3, 5000, generator=g).bfloat16(),
              torch.randn(5000, 3, generator=g).t(), torch.randn(3, 5000, generator=g).double()):  # fmt: skip
        assert torch.equal(ops.argmax(x), x.argmax(-1))
