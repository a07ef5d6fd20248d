"""Block pool: free queue order, O(1) middle removal, eviction from the hash map, the null block; the
"contiguous" placement (lowest free id first)."""

from __future__ import annotations

import random

import pytest

from plinth.sched.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVBlock, LowestIdFreeBlocks
from plinth.sched.kv_cache_manager import KVCacheManager
from plinth.sched.prefix_cache import ROOT_HASH, hash_block_tokens
from plinth.sched.scheduler import Scheduler


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


# -- placement "contiguous": lowest free id first ------------------------------------------------


def test_contiguous_hands_out_lowest_free_ids_after_frees_in_any_order() -> None:
    pool = BlockPool(num_blocks=10, block_size=2, placement="contiguous")
    blocks = pool.allocate(9)
    assert ids(blocks) == list(range(1, 10))
    by_id = {b.block_id: b for b in blocks}
    pool.release([by_id[7], by_id[2], by_id[9], by_id[4]])
    assert pool.free_block_ids() == [2, 4, 7, 9] and pool.num_free_blocks == 4
    assert ids(pool.allocate(2)) == [2, 4]
    pool.release([by_id[1]])
    assert ids(pool.allocate(3)) == [1, 7, 9]
    assert pool.num_free_blocks == 0


def test_contiguous_matches_a_sorted_model_under_random_operations() -> None:
    rng = random.Random(0)
    pool = BlockPool(num_blocks=33, block_size=2, placement="contiguous")
    held: list[KVBlock] = []
    hits = evicted = 0
    for n in range(2000):
        op = rng.random()
        free = sorted(set(range(1, 33)) - {b.block_id for b in held})
        if op < 0.4 and free:
            k = rng.randint(1, len(free))
            hashes = [pool.block(i).block_hash for i in free[:k]]
            got = pool.allocate(k)
            evicted += sum(h is not None and pool.lookup(h) is None for h in hashes)
            assert ids(got) == free[:k] and all(b.ref_cnt == 1 and b.block_hash is None for b in got)
            held += got
        elif op < 0.55 and held:
            block = rng.choice(held)
            pool.cache(block, bytes([n % 256, n // 256]))
        elif op < 0.75:  # a prefix hit on a free cached block takes it from anywhere in the free set
            cached = [pool.block(i) for i in free if pool.block(i).block_hash is not None]
            if cached:
                hit = rng.choice(cached)
                assert pool.lookup(hit.block_hash or b"") is hit
                pool.touch([hit])
                held.append(hit)
                hits += 1
        elif held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            pool.release(held[:k])
            held = held[k:]
        assert pool.num_free_blocks == 32 - len(held) == len(pool.free_block_ids())
        assert len(pool._free._heap) <= pool.num_blocks  # type: ignore[attr-defined]  # lazy deletion is bounded
    assert hits > 50 and evicted > 50  # both paths were exercised


def test_contiguous_free_block_stays_findable_until_handed_out() -> None:
    pool = BlockPool(num_blocks=6, block_size=2, placement="contiguous")
    a, b, c, d, e = pool.allocate(5)
    h = hash_block_tokens(ROOT_HASH, [1, 2])
    assert pool.cache(d, h)
    pool.release([d, b])
    assert pool.lookup(h) is d and pool.free_block_ids() == [2, 4]
    pool.touch([d])  # a prefix hit on the free block: not free any more, never handed out as new
    assert d.ref_cnt == 1 and pool.free_block_ids() == [2] and pool.lookup(h) is d
    assert pool.allocate(1) == [b]
    pool.release([d, a])
    assert pool.lookup(h) is d and pool.free_block_ids() == [1, 4]
    assert pool.allocate(1) == [a] and pool.lookup(h) is d  # a lower id goes first: d still cached
    assert pool.allocate(1) == [d]  # handed out: evicted from the hash map
    assert d.block_hash is None and pool.lookup(h) is None and pool.num_cached_blocks == 0
    pool.release([a, b, c, d, e])
    assert pool.num_free_blocks == 5


@pytest.mark.parametrize("placement", ["any", "contiguous"])
def test_both_placements_keep_ref_counts_and_the_null_block(placement: str) -> None:
    pool = BlockPool(num_blocks=4, block_size=2, placement=placement)
    got = pool.allocate(3)
    assert NULL_BLOCK_ID not in ids(got) and pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.allocate(1)
    pool.touch([got[0]])
    pool.release([got[0]])
    assert got[0].ref_cnt == 1 and pool.num_free_blocks == 0  # still held once
    pool.release(got)
    assert pool.num_free_blocks == 3 and NULL_BLOCK_ID not in pool.free_block_ids()
    with pytest.raises(ValueError, match="ref count 0"):
        pool.release([got[1]])
    assert NULL_BLOCK_ID not in ids(pool.allocate(3))


def test_lowest_id_free_blocks_misuse_is_loud() -> None:
    blocks = [KVBlock(i) for i in range(4)]
    free = LowestIdFreeBlocks(4, blocks[1:])
    assert [b.block_id for b in free] == [1, 2, 3]
    free.remove(blocks[2])
    with pytest.raises(ValueError, match="block 2 is not free"):
        free.remove(blocks[2])
    with pytest.raises(ValueError, match="block 3 is already free"):
        free.append(blocks[3])
    assert free.popleft() is blocks[1] and free.popleft() is blocks[3]
    with pytest.raises(IndexError):
        free.popleft()


def test_unknown_placement_names_the_value_and_the_choices() -> None:
    message = "unknown block placement 'dense': choose one of 'any', 'contiguous'"
    with pytest.raises(ValueError, match=message):
        BlockPool(num_blocks=4, block_size=2, placement="dense")
    with pytest.raises(ValueError, match=message):
        KVCacheManager(4, 2, block_placement="dense")
    with pytest.raises(ValueError, match=message):
        Scheduler(8, 2, 8, 4, 8, block_placement="dense")
