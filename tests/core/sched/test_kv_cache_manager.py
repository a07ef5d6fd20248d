"""KV cache manager: block tables, back-pressure, prefix hits, fork and copy-on-write."""

from __future__ import annotations

import pytest

from plinth.sched.kv_cache_manager import KVCacheManager
from plinth.sched.request import Request, SequenceId, StopCriteria


def req(rid: str, prompt: list[int], sample_index: int = 0) -> Request:
    stop = StopCriteria(max_tokens=8)
    return Request(request_id=rid, prompt_token_ids=list(prompt), stop=stop, params=None, sample_index=sample_index)


def compute(kv: KVCacheManager, r: Request, n: int) -> list[int]:
    """Allocate n tokens, advance as the scheduler would, then register as update() would."""
    table = kv.allocate_slots(r, n)
    assert table is not None
    r.num_computed_tokens += n
    kv.cache_computed_blocks(r)
    return table


def test_table_covers_tokens_and_grows() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = req("a", list(range(6)))
    t = compute(kv, r, 6)
    assert len(t) == 2 and 0 not in t
    r.output_token_ids.append(99)
    assert compute(kv, r, 1) == t  # position 6 still in block 1
    r.output_token_ids.append(98)
    assert compute(kv, r, 1) == t  # position 7 fills block 1
    r.output_token_ids.append(97)
    t2 = compute(kv, r, 1)
    assert t2[:2] == t and len(t2) == 3
    assert kv.num_free_blocks == 9 - 3
    assert kv.usage == pytest.approx(3 / 9)


def test_back_pressure_is_none_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)  # 3 usable
    a = req("a", [1, 2, 3, 4])
    compute(kv, a, 4)
    b = req("b", [5, 6, 7, 8])
    assert kv.allocate_slots(b, 4) is None
    assert kv.block_ids(SequenceId("b", 0)) == [] and kv.num_free_blocks == 1 and kv.num_requests == 1
    assert kv.allocate_slots(b, 2) is not None


def test_prefix_hit_full_blocks_capped_to_leave_last_token() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=4)
    prompt = list(range(12))  # exactly 3 full blocks
    a = req("a", prompt)
    ta = compute(kv, a, 12)
    b = req("b", prompt)
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == ta[:2] and hit.num_tokens == 8  # block 3 is left: its last token recomputes
    tb = kv.allocate_slots(b, 4, hit)
    assert tb is not None and tb[:2] == ta[:2] and tb[2] != ta[2]
    assert [kv.pool.block(i).ref_cnt for i in ta] == [2, 2, 1]
    c = req("c", prompt + [50])  # 3 full blocks + 1: all three hit
    assert kv.get_computed_blocks(c).block_ids == ta


def test_hits_on_free_cached_blocks_and_eviction_order() -> None:
    kv = KVCacheManager(num_blocks=7, block_size=2)  # 6 usable
    a = req("a", [1, 2, 3, 4, 5, 6, 7])
    ta = compute(kv, a, 7)  # 4 blocks, 3 full ones cached
    kv.free(a)
    assert kv.num_free_blocks == 6
    # free order: the 2 never-used blocks, then a's blocks tail first
    assert kv.pool.free_block_ids()[-4:] == ta[::-1]
    b = req("b", [1, 2, 3, 4, 9, 9, 9])
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == ta[:2]
    tb = kv.allocate_slots(b, 3, hit)
    assert tb is not None and tb[:2] == ta[:2]
    # b's 2 new blocks came from the head: the never-used ones, so a's third block is still cached
    c = req("c", [1, 2, 3, 4, 5, 6, 0])
    assert kv.get_computed_blocks(c).block_ids == ta[:3]


def test_free_hits_count_against_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)  # 3 usable
    a = req("a", [1, 2, 3, 4, 5])
    ta = compute(kv, a, 5)  # 2 full cached blocks + 1 partial
    kv.free(a)
    d = req("d", [8])
    assert compute(kv, d, 1) == [ta[2]]  # the head of the free queue: a's partial tail block
    b = req("b", [1, 2, 3, 4, 5])
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == ta[:2]
    # 2 free blocks left, both of them b's hits: taking them plus 1 new block needs 3
    assert kv.allocate_slots(b, 1, hit) is None
    assert kv.num_free_blocks == 2 and all(kv.pool.block(i).ref_cnt == 0 for i in ta[:2])
    kv.free(d)
    tb = kv.allocate_slots(b, 1, kv.get_computed_blocks(b))
    assert tb is not None and tb[:2] == ta[:2]


def test_fork_shares_blocks_and_copy_on_write_of_partial_block() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=4)
    p = req("p", list(range(6)))
    tp = compute(kv, p, 6)
    children = [req("p", list(range(6)), i) for i in (1, 2)]
    for c in children:
        c.num_computed_tokens = 6
        kv.fork(p, c)
    assert [kv.pool.block(i).ref_cnt for i in tp] == [3, 3]
    for r in [p, *children]:
        r.output_token_ids.append(7)
    t0 = kv.allocate_slots(p, 1)
    t1 = kv.allocate_slots(children[0], 1)
    t2 = kv.allocate_slots(children[1], 1)
    assert t0 is not None and t1 is not None and t2 is not None
    assert t0[0] == t1[0] == t2[0] == tp[0]  # the full block stays shared
    assert t2[1] == tp[1]  # the last writer keeps the original in place
    assert len({t0[1], t1[1], t2[1]}) == 3
    assert kv.take_block_copies() == [(tp[1], t0[1]), (tp[1], t1[1])]
    assert kv.take_block_copies() == []
    assert [kv.pool.block(i).ref_cnt for i in (tp[0], t0[1], t1[1], t2[1])] == [3, 1, 1, 1]


def test_no_copy_on_write_when_fork_point_is_block_aligned() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=4)
    p = req("p", list(range(8)))
    tp = compute(kv, p, 8)
    c = req("p", list(range(8)), 1)
    c.num_computed_tokens = 8
    kv.fork(p, c)
    for r in (p, c):
        r.output_token_ids.append(1)
        t = kv.allocate_slots(r, 1)
        assert t is not None and t[:2] == tp and len(t) == 3
    assert kv.take_block_copies() == []


def test_copy_on_write_back_pressure() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)  # 2 usable
    p = req("p", [1, 2, 3, 4, 5])
    compute(kv, p, 5)  # both blocks used
    c = req("p", [1, 2, 3, 4, 5], 1)
    c.num_computed_tokens = 5
    kv.fork(p, c)
    p.output_token_ids.append(1)
    assert kv.allocate_slots(p, 1) is None  # the private copy needs a block
    assert kv.take_block_copies() == []
    kv.free(c)
    assert kv.allocate_slots(p, 1) is not None  # now p is the only owner: writes in place
    assert kv.take_block_copies() == []


def test_cache_only_registers_computed_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = req("a", list(range(10)))
    kv.allocate_slots(a, 10)  # scheduled but not computed yet
    b = req("b", list(range(10)))
    assert kv.get_computed_blocks(b).block_ids == []
    a.num_computed_tokens = 10
    kv.cache_computed_blocks(a)
    assert len(kv.get_computed_blocks(b).blocks) == 2
    assert kv.pool.num_cached_blocks == 2  # the partial third block is never cached


def test_prefix_caching_off() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=False)
    a = req("a", list(range(10)))
    compute(kv, a, 10)
    assert kv.get_computed_blocks(req("b", list(range(10)))).blocks == []
    assert kv.pool.num_cached_blocks == 0


def test_free_returns_everything() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=4)
    p = req("p", list(range(9)))
    compute(kv, p, 9)
    c = req("p", list(range(9)), 1)
    c.num_computed_tokens = 9
    kv.fork(p, c)
    kv.free(p)
    assert kv.num_free_blocks == 19 - 3
    kv.free(c)
    kv.free(c)  # harmless
    assert kv.num_free_blocks == 19 and kv.num_requests == 0
    assert all(kv.pool.block(i).ref_cnt == 0 for i in range(20))


def test_misuse_is_loud() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = req("a", list(range(9)))
    with pytest.raises(ValueError):
        kv.allocate_slots(a, 0)
    compute(kv, a, 9)
    with pytest.raises(ValueError, match="already holds"):
        kv.get_computed_blocks(a)
    with pytest.raises(ValueError, match="no blocks"):
        kv.fork(req("x", [1]), req("x", [1], 1))
