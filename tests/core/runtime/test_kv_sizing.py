"""How many KV blocks every rank allocates: the rank with the least room decides; ranks on one device
share its memory, ranks on their own devices do not."""

from __future__ import annotations

import pytest

from plinth.config import EngineConfig
from plinth.parallel.executor import RankMemory
from plinth.runtime.parts import DEFAULT_KV_FRACTION, InvalidRequest, kv_blocks

GIB = 1 << 30
CONFIG = EngineConfig(model="unused")


def _rank(host: str, device: str, free_gib: float, block_bytes: int) -> RankMemory:
    return RankMemory(host, device, int(free_gib * GIB), block_bytes)


def test_one_rank_takes_its_fraction_of_free_memory() -> None:
    got = kv_blocks([_rank("a", "cpu", 1.0, 1 << 20)], CONFIG, needed=10**9)
    assert got == int(GIB * DEFAULT_KV_FRACTION) // (1 << 20)


def test_ranks_on_one_device_share_it_and_gpus_do_not() -> None:
    block = 1 << 20
    shared = [_rank("a", "cpu", 2.0, block), _rank("a", "cpu", 2.0, block)]  # one host's memory, counted twice
    own = [_rank("a", "cuda:0", 2.0, block), _rank("a", "cuda:1", 2.0, block)]
    assert kv_blocks(shared, CONFIG, needed=10**9) == int(GIB * DEFAULT_KV_FRACTION) // block
    assert kv_blocks(own, CONFIG, needed=10**9) == int(2 * GIB * DEFAULT_KV_FRACTION) // block
    other_hosts = [_rank("a", "cpu", 2.0, block), _rank("b", "cpu", 2.0, block)]
    assert kv_blocks(other_hosts, CONFIG, needed=10**9) == kv_blocks(own, CONFIG, needed=10**9)


def test_the_deepest_stage_or_the_fullest_device_decides() -> None:
    stages = [_rank("a", "cuda:0", 2.0, 1 << 20), _rank("a", "cuda:1", 2.0, 3 << 20)]  # stage 1: 3x the layers
    assert kv_blocks(stages, CONFIG, needed=10**9) == int(2 * GIB * DEFAULT_KV_FRACTION) // (3 << 20)
    fuller = [_rank("a", "cuda:0", 2.0, 1 << 20), _rank("a", "cuda:1", 0.5, 1 << 20)]
    assert kv_blocks(fuller, CONFIG, needed=10**9) == int(0.5 * GIB * DEFAULT_KV_FRACTION) // (1 << 20)
    assert kv_blocks(fuller, CONFIG, needed=7) == 7  # never more than max_num_seqs full contexts


def test_the_users_sizes_win_and_a_rank_without_room_is_named() -> None:
    ranks = [_rank("a", "cpu", 2.0, 1 << 20), _rank("b", "cpu", 2.0, 1 << 20)]
    assert kv_blocks(ranks, EngineConfig(model="unused", num_kv_blocks=33), needed=10**9) == 33
    assert kv_blocks(ranks, EngineConfig(model="unused", kv_cache_memory_gb=0.5), needed=10**9) == 512
    starved = [_rank("a", "cpu", 2.0, 1 << 20), _rank("b", "cpu", 0.000001, 1 << 20)]
    with pytest.raises(InvalidRequest, match="on rank 1 holds no block"):
        kv_blocks(starved, CONFIG, needed=10**9)
