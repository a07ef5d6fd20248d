"""Block pool: free queue order, O(1) middle removal, eviction from the hash map, the null block."""

from __future__ import annotations

import pytest

from plinth.sched.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVBlock
from plinth.sched.prefix_cache import ROOT_HASH, hash_block_tokens


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_append_popleft_remove_middle() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5 and [b.block_id for b in q] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.remove(blocks[4])  # the old tail
    assert [b.block_id for b in q] == [1, 3, 2]
    with pytest.raises(ValueError):
        q.remove(blocks[4])  # not in the queue any more
    for _ in range(3):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    assert pool.num_usable_blocks == 3 and pool.num_free_blocks == 3
    got = pool.allocate(3)
    assert NULL_BLOCK_ID not in ids(got)
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.allocate(1)


def test_pool_rejects_too_small() -> None:
    with pytest.raises(ValueError, match="reserved"):
        BlockPool(num_blocks=1, block_size=4)
    with pytest.raises(ValueError):
        BlockPool(num_blocks=4, block_size=0)


def test_eviction_order_is_free_order_and_pop_evicts_hash() -> None:
    pool = BlockPool(num_blocks=5, block_size=2)
    a, b, c, d = pool.allocate(4)
    h = hash_block_tokens(ROOT_HASH, [1, 2])
    assert pool.cache(b, h)
    pool.release([c, a])  # freed c first, then a
    pool.release([b])
    assert pool.free_block_ids() == [c.block_id, a.block_id, b.block_id]
    assert pool.lookup(h) is b  # a free block stays findable
    assert pool.allocate(2) == [c, a]
    (got,) = pool.allocate(1)
    assert got is b and b.block_hash is None and pool.lookup(h) is None
    assert pool.num_cached_blocks == 0
    pool.release([d, b, a, c])


def test_touch_takes_free_cached_block_out_of_the_middle() -> None:
    pool = BlockPool(num_blocks=5, block_size=2)
    blocks = pool.allocate(4)
    pool.cache(blocks[1], b"x")
    pool.release(blocks)
    assert pool.num_free_blocks == 4
    hit = pool.lookup(b"x")
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 3
    assert hit.block_id not in pool.free_block_ids()
    pool.touch([hit])
    assert hit.ref_cnt == 2
    pool.release([hit, hit])
    assert pool.free_block_ids()[-1] == hit.block_id


def test_cache_first_registration_wins() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"h")
    assert not pool.cache(b, b"h") and b.block_hash is None
    assert not pool.cache(a, b"other")  # already cached under its own hash
    assert pool.lookup(b"h") is a


def test_release_below_zero_is_a_bug() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    (a,) = pool.allocate(1)
    pool.release([a])
    with pytest.raises(ValueError, match="ref count 0"):
        pool.release([a])


def test_chained_hash_commits_to_parent() -> None:
    h1 = hash_block_tokens(ROOT_HASH, [1, 2])
    assert h1 == hash_block_tokens(ROOT_HASH, [1, 2])
    assert h1 != hash_block_tokens(ROOT_HASH, [2, 1])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(hash_block_tokens(ROOT_HASH, [9, 9]), [3, 4])
