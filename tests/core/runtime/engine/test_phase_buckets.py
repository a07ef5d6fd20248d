"""Contract 1.6: separate decode buckets, flat block lists, and the capabilities that ask for them."""

from __future__ import annotations

import pytest
import torch

from plinth.platform.backend import AttentionMetadata, FlatBlocks, StepBuckets, StepInputs, StepShape
from plinth.platform.values import Capabilities
from plinth.runtime.static import pad_inputs
from plinth.sampling_params import SamplingParams
from plinth.sched.output import ScheduledChunk
from plinth.sched.request import SequenceId

BLOCK = 4


def _buckets() -> StepBuckets:
    flat = (1, 2, 4, 8, 16, 32)
    decode = StepBuckets(tokens=(1, 2, 4, 8), seqs=(1, 2, 4, 8), blocks_per_seq=(4,), flat_blocks=flat)
    return StepBuckets(tokens=(8, 16), seqs=(1, 2, 4, 8), blocks_per_seq=(4,), flat_blocks=flat, decode=decode)


def test_decode_steps_fit_the_decode_set_and_others_the_prefill_set() -> None:
    b = _buckets()
    assert b.fit(3, 3, 2, 5, decode=True) == StepShape(4, 4, 4, 8, decode=True)
    assert b.fit(3, 3, 2, 5) == StepShape(8, 4, 4, 8)  # the same sizes, not all decodes
    assert b.fit(9, 1, 3, 3) == StepShape(16, 1, 4, 4)
    assert b.fit(9, 1, 3, 33) is None  # more blocks than the largest flat bucket
    assert b.fit(9, 9, 1, 9, decode=True) is None


def test_shapes_cover_every_reachable_step_and_mark_the_decode_set() -> None:
    b = _buckets()
    shapes = set(b.shapes())
    assert len(shapes) == len(b.shapes())
    for seqs in range(1, 9):  # decode steps: T == B, each sequence 1..4 blocks
        for per in range(1, 5):
            for total in range(seqs, seqs * per + 1):
                assert b.fit(seqs, seqs, per, total, decode=True) in shapes, (seqs, per, total)
    for tokens in range(1, 17):  # prefill steps
        for seqs in range(1, min(tokens, 8) + 1):
            for total in (seqs, min(seqs * 4, 32)):
                assert b.fit(tokens, seqs, 4, total) in shapes, (tokens, seqs, total)
    decode = [s for s in shapes if s.decode]
    assert decode and all(s.tokens == s.seqs for s in decode)
    # a decode step of 8 sequences never has fewer than 5 blocks: no 8-sequence shape of 1, 2 or 4
    assert not [s for s in decode if s.seqs == 8 and s.flat_blocks < 8]


def test_a_decode_set_whose_tokens_and_seqs_never_meet_is_refused() -> None:
    bad = StepBuckets(tokens=(16,), seqs=(1, 2), blocks_per_seq=(1,))
    with pytest.raises(ValueError, match="share no value"):
        StepBuckets(tokens=(16,), seqs=(1,), blocks_per_seq=(1,), decode=bad)


def test_flat_blocks_list_each_sequence_in_order_and_pad_to_group_b() -> None:
    flat = FlatBlocks.build([5, 1, 9], [[7, 3, 0], [2, 0, 0], [4, 6, 8]], BLOCK, pad_to=8, num_seqs=4)
    assert flat.block_list.tolist() == [7, 3, 2, 4, 6, 8, 0, 0]
    assert flat.block_groups.tolist() == [0, 0, 1, 2, 2, 2, 4, 4]
    assert flat.block_index.tolist() == [0, 1, 0, 0, 1, 2, 0, 0]
    assert flat.num_blocks == 6 == FlatBlocks.count([5, 1, 9], BLOCK)
    with pytest.raises(ValueError, match="6 blocks does not fit in 5"):
        FlatBlocks.build([5, 1, 9], [[7, 3, 0], [2, 0, 0], [4, 6, 8]], BLOCK, pad_to=5)


def test_metadata_builds_the_flat_list_and_says_when_every_query_is_one_token() -> None:
    meta = AttentionMetadata.from_lengths([1, 1], [5, 2], [[3, 4], [9, 0]], block_size=BLOCK)
    assert meta.decode_only and meta.flat_blocks is None
    flat = FlatBlocks.from_metadata(meta, BLOCK)
    assert flat.block_list.tolist() == [3, 4, 9] and flat.block_groups.tolist() == [0, 0, 1]
    assert not AttentionMetadata.from_lengths([2, 1], [5, 2], [[3, 4], [9, 0]], block_size=BLOCK).decode_only


def _chunk(name: str, start: int, n: int, blocks: list[int]) -> ScheduledChunk[SamplingParams]:
    return ScheduledChunk(SequenceId(name, 0), list(range(100, 100 + n)), start, blocks, ())


def test_padded_inputs_carry_the_flat_list_and_the_dummy_step_one_entry() -> None:
    chunks = [_chunk("a", 4, 1, [5, 6]), _chunk("b", 0, 3, [2])]
    x = pad_inputs(chunks, StepShape(8, 4, 2, 4), BLOCK)
    assert x.flat_blocks is not None
    assert x.flat_blocks.block_list.tolist() == [5, 6, 2, 0] and x.flat_blocks.block_groups.tolist() == [0, 0, 1, 4]
    assert set(x.tensors()) >= {"flat_block_list", "flat_block_groups", "flat_block_index"}
    assert "flat_block_list" not in pad_inputs(chunks, StepShape(8, 4, 2), BLOCK).tensors()
    d = StepInputs.dummy(StepShape(4, 4, 2, 8, decode=True))
    assert d.flat_blocks is not None and d.flat_blocks.block_list.shape == (8,)
    assert d.flat_blocks.block_groups.tolist() == [0] + [4] * 7 and torch.all(d.slot_mapping == -1)


def test_capabilities_refuse_an_unknown_placement_and_an_undeclared_preferred_block_size() -> None:
    base = dict(dtypes=frozenset({"float32"}), kv_cache_dtypes=frozenset({"float32"}), head_sizes=frozenset({64}))
    with pytest.raises(ValueError, match="block_placement 'dense'"):
        Capabilities(**base, block_sizes=(16,), block_placement="dense")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="preferred_block_size 128 is not among"):
        Capabilities(**base, block_sizes=(16,), preferred_block_size=128)  # type: ignore[arg-type]
    caps = Capabilities(**base, block_sizes=(16, 128), preferred_block_size=128)  # type: ignore[arg-type]
    assert caps.mixed_batches and caps.block_placement == "any" and caps.communicator is None
