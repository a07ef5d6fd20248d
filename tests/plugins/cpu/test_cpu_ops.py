"""CpuOps.argmax: the sliced two-pass argmax the sampler picks tokens with on this backend."""

from __future__ import annotations

import pytest
import torch

from plinth.platform.backend import SmallOps
from plinth_cpu import CpuBackend
from plinth_cpu.ops import ARGMAX_CHUNK, TorchOps, sliced_argmax


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
