"""LoRA in the scheduling layer: an adapter is an int id, its blocks are its own in the prefix cache,
chunks and forks carry it."""

from __future__ import annotations

from plinth.sched.kv_cache_manager import KVCacheManager
from plinth.sched.prefix_cache import ROOT_HASH, root_hash
from plinth.sched.request import Request, SequenceId, StopCriteria
from plinth.sched.scheduler import Scheduler

PROMPT = list(range(100, 113))  # three full blocks of 4 and one token


def req(rid: str, lora_id: int, n: int = 1) -> Request:
    return Request(rid, list(PROMPT), StopCriteria(max_tokens=4), params=None, n=n, lora_id=lora_id)


def test_root_hash_per_adapter() -> None:
    assert root_hash(0) == ROOT_HASH
    assert len({root_hash(i) for i in range(4)}) == 4


def test_blocks_are_shared_within_an_adapter_only() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    first = req("a", lora_id=1)
    assert kv.allocate_slots(first, len(PROMPT)) is not None
    first.num_computed_tokens = len(PROMPT)
    kv.cache_computed_blocks(first)
    assert kv.get_computed_blocks(req("b", lora_id=2)).num_tokens == 0
    assert kv.get_computed_blocks(req("c", lora_id=0)).num_tokens == 0
    assert kv.get_computed_blocks(req("d", lora_id=1)).num_tokens == 12


def test_chunks_and_forks_carry_the_adapter() -> None:
    s = Scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64)
    s.add_request(req("p", lora_id=7, n=2))
    s.add_request(req("q", lora_id=0))
    out = s.schedule()
    assert {c.seq_id.request_id: c.lora_id for c in out.scheduled} == {"p": 7, "q": 0}
    s.update(out, {SequenceId("p", 0): 1, SequenceId("p", 1): 2, SequenceId("q", 0): 3})
    out = s.schedule()
    assert {c.seq_id: c.lora_id for c in out.scheduled} == {
        SequenceId("p", 0): 7,
        SequenceId("p", 1): 7,
        SequenceId("q", 0): 0,
    }
