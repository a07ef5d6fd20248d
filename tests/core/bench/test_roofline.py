"""The limits the benchmarks hold the engine to: the weight stream covers the model's linear weights
exactly, in place, and the GEMM peak measures what it is asked."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from plinth.bench.roofline import (
    PROBE_FLOATS,
    WeightStream,
    gemm_peak,
    weight_bytes_per_token,
    weight_stream,
    weight_stream_probes,
    weight_tensors,
)
from plinth.platform.backend import DeviceServices

sys.path.insert(0, str(Path(__file__).parents[1] / "runtime" / "engine"))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_the_stream_cuts_odd_sizes_into_probe_blocks_and_a_rest_that_covers_every_byte() -> None:
    chunk = PROBE_FLOATS * 4
    arena = torch.zeros(3 * chunk + 64, dtype=torch.uint8)
    tensors = [
        torch.zeros(2 * PROBE_FLOATS),  # exactly two blocks
        torch.zeros(PROBE_FLOATS + 5, dtype=torch.bfloat16),  # under one block: all rest, 2-byte tail
        torch.zeros(3 * PROBE_FLOATS + 3),  # a block-sized body and a 12-byte tail
        arena[1 : 2 * chunk + 2],  # starts off a 4-byte boundary: a 3-byte head, one block, a tail
        torch.zeros(4, 4).t(),  # not contiguous: read as it is
        torch.zeros(0),
    ]
    stream = WeightStream.of(tensors, torch.device("cpu"))
    assert stream.nbytes == sum(_nbytes(t) for t in tensors)
    assert all(b.dtype == torch.float32 and b.numel() % PROBE_FLOATS == 0 for b in stream.blocks)
    assert [b.numel() // PROBE_FLOATS for b in stream.blocks] == [2, 3, 1]
    assert stream.blocks[2].data_ptr() == arena.data_ptr() + 4  # in place: after the 3-byte head
    # the bf16 tensor as fp32 + 2 bytes; the 12-byte tail; the arena's head, tail as fp32 + 2 bytes; the transpose
    assert [_nbytes(r) for r in stream.rest] == [8200, 2, 12, 3, chunk - 4, 2, 64]


def test_the_stream_of_a_model_is_its_linear_weights_in_place(tmp_path: Path) -> None:
    from engine_helpers import save_tiny_folder

    from plinth import LLM

    save_tiny_folder("llama", tmp_path)
    llm = LLM(model=str(tmp_path), backend="cpu", num_kv_blocks=16, block_size=16)
    model, services = llm.engine.model, llm.engine.backend.device_services()
    stream = weight_stream(model, services)
    assert stream.nbytes == weight_bytes_per_token(model) > 0
    spans = [(t.data_ptr(), t.data_ptr() + _nbytes(t)) for t in weight_tensors(model)]
    for block in stream.blocks:  # each block lies inside one of the weights: no copies
        assert any(lo <= block.data_ptr() and block.data_ptr() + _nbytes(block) <= hi for lo, hi in spans)
    gbps = weight_stream_probes(services, stream, repeats=2)
    assert set(gbps) == set(services.read_probes())
    assert all(g > 0 for g in gbps.values())
    assert max(gbps.values()) * 1e9 / stream.nbytes > 0  # the tok/s limit


def test_gemm_peak_reports_every_dtype_and_shape() -> None:
    services = DeviceServices(torch.device("cpu"))
    peaks = gemm_peak(services, [(64, 32, 48), (16, 16, 16)], dtypes=("bfloat16", "float32"), repeats=2)
    assert set(peaks) == {"bfloat16", "float32"}
    for figures in peaks.values():
        assert set(figures) == {"64x32x48", "16x16x16"}
        assert all(g > 0 for g in figures.values())


def test_gemm_peak_gives_up_repeats_past_its_budget() -> None:
    calls = []

    class Counting(DeviceServices):
        def synchronize(self) -> None:
            calls.append(1)

    gemm_peak(Counting(torch.device("cpu")), [(8, 8, 8)], dtypes=("float32",), repeats=50, budget_s=0.0)
    assert len(calls) == 2  # the warm-up and one timed call: over the budget after it


def test_tensors_on_another_device_are_left_to_torch() -> None:
    tensors = [torch.zeros(PROBE_FLOATS)]
    assert len(WeightStream.of(tensors, torch.device("cpu")).blocks) == 1
    elsewhere = WeightStream.of(tensors, torch.device("meta"))
    assert elsewhere.blocks == () and elsewhere.rest == (tensors[0],) and elsewhere.nbytes == 4 * PROBE_FLOATS
