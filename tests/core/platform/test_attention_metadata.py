"""AttentionMetadata.from_lengths: the one constructor of a varlen batch's metadata."""

from __future__ import annotations

import pytest
import torch

from plinth.platform.backend import AttentionMetadata


def test_a_mixed_batch_from_lengths_and_block_lists() -> None:
    # sequence 0: a prefill chunk of 3 after 2 cached tokens; 1: a decode at position 4; 2: a fresh prompt of 2
    meta = AttentionMetadata.from_lengths([3, 1, 2], [5, 5, 2], [[7, 3], [4, 9], [6]], block_size=4)
    assert meta.query_start_loc.tolist() == [0, 3, 4, 6] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [5, 5, 2] and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == [[7, 3], [4, 9], [6, 0]]  # padded with block 0
    # positions 2, 3, 4 | 4 | 0, 1 -> block * 4 + offset
    assert meta.slot_mapping.tolist() == [30, 31, 12, 36, 24, 25] and meta.slot_mapping.dtype == torch.int64
    assert (meta.max_query_len, meta.max_seq_len, meta.num_seqs) == (3, 5, 3)
    assert (meta.query_lens_host, meta.seq_lens_host) == ([3, 1, 2], [5, 5, 2])


def test_given_tensors_are_used_as_they_are() -> None:
    """A step graph's fixed buffers must be the tensors the metadata holds: replays read them."""
    seq_lens = torch.tensor([3, 9], dtype=torch.int32)
    tables = torch.tensor([[1, 0, 0], [2, 5, 8]], dtype=torch.int32)
    slots = torch.tensor([-1, 37], dtype=torch.int64)
    starts = torch.arange(3, dtype=torch.int32)
    meta = AttentionMetadata.from_lengths(
        [1, 1], seq_lens, tables, slot_mapping=slots, query_start_loc=starts, max_seq_len=64
    )
    assert meta.seq_lens is seq_lens and meta.block_tables is tables
    assert meta.slot_mapping is slots and meta.query_start_loc is starts
    assert meta.seq_lens_host == [3, 9] and meta.max_seq_len == 64


def test_slots_come_from_exactly_one_place() -> None:
    with pytest.raises(ValueError, match="exactly one of block_size and slot_mapping"):
        AttentionMetadata.from_lengths([1], [1], [[1]])
    with pytest.raises(ValueError, match="exactly one"):
        AttentionMetadata.from_lengths([1], [1], [[1]], block_size=4, slot_mapping=torch.zeros(1, dtype=torch.long))
