"""plinth.platform.quant: a quantized embedding's rows dequantized on lookup."""

from __future__ import annotations

import pytest
import torch

from plinth.platform.quant import dequantize, dequantize_rows
from plinth_conformance.quantized import random_weight


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("index", [[3], [0, 7, 7, 2], []])  # one token; repeats and any order; none
def test_dequantize_rows_is_the_rows_of_the_whole_weight(fmt: str, index: list[int]) -> None:
    """Row for row what dequantizing the whole weight gives, bit for bit (ggml's exact arithmetic)."""
    gen = torch.Generator().manual_seed(0)
    weight = random_weight(fmt, 8, 96, gen)
    ids = torch.tensor(index, dtype=torch.long)
    got = dequantize_rows(weight, ids)
    assert got.shape == (len(index), 96) and got.dtype == torch.float32
    assert torch.equal(got, dequantize(weight)[ids])
    assert torch.equal(got, dequantize(weight.rows(ids)))
