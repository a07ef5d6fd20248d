"""The pool of paged KV blocks: ref counts, the free blocks, and the hash -> block map of the prefix cache.

Which free block is handed out next is the pool's *placement* (``BlockPool(..., placement=...)``).
Under both placements a free block still carries its hash and stays findable in the hash -> block
map until it is handed out: a block handed out is evicted from the map, and a prefix hit on a free
block takes it out of the free blocks (so a hit is never handed out as a "new" block).

``"any"`` (the default): a free queue in LRU order, the one rule the prefix cache is tuned for.

- a block whose ref count drops to 0 is appended at the TAIL of the free queue, in the order it is
  freed; a request frees its blocks in reverse table order, so its tail blocks (the least shared
  suffix of a prompt) sit ahead of its head blocks and are evicted first;
- allocation pops from the HEAD (the least recently freed block);
- a prefix hit on a free block removes it from the middle of the queue in O(1) (the queue is a
  doubly linked list through the blocks themselves).

``"contiguous"``: allocation hands out the LOWEST free block id first, so the blocks of the running
requests crowd into a low, dense id range (a kernel that reads a few sequences' blocks can slice
that range instead of gathering). Eviction order is then by block id, not LRU: a cached free block
with a low id is evicted before a higher one freed long ago. O(log n) per block: a min-heap of free
ids, where a prefix hit leaves the block's entry in place and marks it taken (lazy deletion).

Block id 0 (``NULL_BLOCK_ID``) is reserved: it is never allocated, freed or cached, so the runner may
point padding entries of block tables (and slot mappings of padding tokens) at it. A pool of
``num_blocks`` therefore has ``num_blocks - 1`` usable blocks.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

NULL_BLOCK_ID = 0
"""The reserved padding block: never handed to a request."""

BlockHash = bytes
"""The chained hash of a full block (see ``plinth.sched.prefix_cache.hash_block_tokens``)."""

BLOCK_PLACEMENTS = ("any", "contiguous")
"""The placements ``BlockPool`` accepts (see the module docstring)."""


@dataclass(slots=True, eq=False)
class KVBlock:
    """One KV block of ``block_size`` token slots.

    ``ref_cnt`` counts the requests whose block table holds the block; ``block_hash`` is set while
    the block is in the prefix cache's hash -> block map (only full, computed blocks are).
    ``prev_free``/``next_free`` link the block into the free queue while ``ref_cnt`` is 0 (placement
    ``"any"`` only).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """A doubly linked list of free blocks with O(1) append, pop-left and removal from the middle.

    Two sentinel nodes (never real blocks) make every real node have both neighbours, so removal
    needs no special cases.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        """Blocks from the head (next evicted) to the tail (most recently freed)."""
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def append(self, block: KVBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None and block.next_free is None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def popleft(self) -> KVBlock:
        """Take the block at the head (the least recently freed). Raises IndexError when empty."""
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("pop from an empty free block queue")
        self.remove(first)
        return first

    def remove(self, block: KVBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue (a prefix hit on a free block)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1


class FreeBlocks(Protocol):
    """The pool's free blocks: the order of ``popleft`` is the pool's placement and eviction order."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[KVBlock]:
        """Free blocks, the next one handed out first."""
        ...

    def append(self, block: KVBlock) -> None:
        """Take in a block whose ref count just dropped to 0."""
        ...

    def popleft(self) -> KVBlock:
        """Take out the next block to hand out. Raises IndexError when empty."""
        ...

    def remove(self, block: KVBlock) -> None:
        """Take out ``block`` (a prefix hit on a free block). Raises ValueError when it is not free."""
        ...


class LowestIdFreeBlocks:
    """Free blocks handed out lowest id first: a min-heap of ids with lazy deletion.

    ``remove`` (a prefix hit) only marks the block taken; its heap entry goes stale and ``popleft``
    skips it. A block keeps at most one heap entry (``_in_heap``), so the heap never outgrows the
    pool however often a cached block is hit and freed again, and each stale entry costs one pop.
    """

    def __init__(self, num_blocks: int, blocks: Iterable[KVBlock] = ()) -> None:
        self._heap: list[int] = []
        self._free = [False] * num_blocks  # by block id: free now
        self._in_heap = [False] * num_blocks  # by block id: has an entry in _heap (live or stale)
        self._by_id: dict[int, KVBlock] = {}
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        """Free blocks from the lowest id (next handed out) up."""
        return (self._by_id[i] for i in sorted(i for i in self._by_id if self._free[i]))

    def append(self, block: KVBlock) -> None:
        """Mark ``block`` free (ref count 0)."""
        i = block.block_id
        if self._free[i]:
            raise ValueError(f"block {i} is already free")
        self._free[i] = True
        self._by_id[i] = block
        self._len += 1
        if not self._in_heap[i]:  # a stale entry of its own revives instead
            self._in_heap[i] = True
            heapq.heappush(self._heap, i)

    def popleft(self) -> KVBlock:
        """Take the free block with the lowest id. Raises IndexError when empty."""
        while self._heap:
            i = heapq.heappop(self._heap)
            self._in_heap[i] = False
            if self._free[i]:
                self._free[i] = False
                self._len -= 1
                return self._by_id[i]
        raise IndexError("pop from an empty set of free blocks")

    def remove(self, block: KVBlock) -> None:
        """Take ``block`` out of the free blocks (its heap entry goes stale)."""
        i = block.block_id
        if not self._free[i]:
            raise ValueError(f"block {i} is not free")
        self._free[i] = False
        self._len -= 1


class BlockPool:
    """Owns every KV block: hands out free ones, takes them back, and keeps the hash -> block map.

    The pool knows nothing of requests; the KV cache manager keeps the block tables. With prefix
    caching off the hash map simply stays empty.

    :param placement: which free block is handed out next: ``"any"`` (least recently freed first)
        or ``"contiguous"`` (lowest id first); see the module docstring.
    """

    def __init__(self, num_blocks: int, block_size: int, placement: str = "any") -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block {NULL_BLOCK_ID} is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if placement not in BLOCK_PLACEMENTS:
            choices = ", ".join(map(repr, BLOCK_PLACEMENTS))
            raise ValueError(f"unknown block placement {placement!r}: choose one of {choices}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.placement = placement
        self._blocks = [KVBlock(i) for i in range(num_blocks)]
        usable = self._blocks[NULL_BLOCK_ID + 1 :]
        self._free: FreeBlocks = (
            FreeBlockQueue(usable) if placement == "any" else LowestIdFreeBlocks(num_blocks, usable)
        )
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        """All blocks but the reserved null block."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not (a cached free block is evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by at least one request (0.0 .. 1.0)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently findable in the hash -> block map (in use or free)."""
        return len(self._cached)

    def block(self, block_id: int) -> KVBlock:
        """The block with id ``block_id`` (read it; do not change its fields)."""
        return self._blocks[block_id]

    def free_block_ids(self) -> list[int]:
        """Ids of the free blocks, the next one handed out (evicted) first."""
        return [b.block_id for b in self._free]

    def allocate(self, num: int) -> list[KVBlock]:
        """Hand out ``num`` free blocks in placement order, each with ref count 1.

        A popped block that still carries a hash is evicted from the hash map first. The caller
        checks ``num_free_blocks`` beforehand: asking for more is a bug, not back-pressure.
        """
        if num > len(self._free):
            raise ValueError(f"asked for {num} blocks, only {len(self._free)} free")
        out: list[KVBlock] = []
        for _ in range(num):
            block = self._free.popleft()
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each block, taking free ones (prefix hits) out of the free blocks."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in the given order; blocks reaching 0 become free
        (under ``"any"`` they join the free queue's tail).

        Pass a request's blocks in reverse table order (see the module docstring for why).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} released with ref count {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free.append(block)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block with this hash, in use or free; None on a miss."""
        return self._cached.get(block_hash)

    def cache(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Make ``block`` findable by ``block_hash``.

        Returns False (and changes nothing) when the block is already cached or another block holds
        the hash (two requests computed the same block at once: the first one registered wins).
        """
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True
