"""The block manager: per-request block tables over the block pool, prefix hits, forks, copy-on-write.

The scheduler talks to this class only; it never sees the pool's free queue or hash map. It passes
requests in and gets block ids (plain ints) or ``None`` back: "cannot allocate" is a return value.
"""

from __future__ import annotations

from dataclasses import dataclass

from plinth.sched.block_pool import BlockPool, KVBlock
from plinth.sched.prefix_cache import HashPrefixCache, NoPrefixCache, PrefixCache
from plinth.sched.request import Request, SequenceId


@dataclass(slots=True)
class ComputedBlocks:
    """Prefix-cache hits for a request about to be admitted: its leading full blocks, already computed.

    Valid only until the next call that changes the pool: pass it straight to ``allocate_slots``.
    """

    blocks: list[KVBlock]
    block_size: int

    @property
    def num_tokens(self) -> int:
        """Tokens the hits cover (whole blocks)."""
        return len(self.blocks) * self.block_size

    @property
    def block_ids(self) -> list[int]:
        """The hit blocks' ids, in table order."""
        return [b.block_id for b in self.blocks]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block tables over a ``BlockPool``.

    A request's table covers exactly the tokens allocated for it so far (``ceil(tokens /
    block_size)`` blocks). Writes only happen at positions >= ``num_computed_tokens``; the only block
    in that range that can be shared (ref count > 1) is the last, partial block after a ``fork``.
    ``allocate_slots`` gives such a block a private copy first (copy-on-write) and records the
    ``(src, dst)`` pair, collected with ``take_block_copies`` for the runner to copy before the step.

    ``block_placement`` is the pool's (``"any"`` or ``"contiguous"``: see ``plinth.sched.block_pool``).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, block_placement: str = "any"
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size, block_placement)
        self.block_size = block_size
        self._prefix: PrefixCache = HashPrefixCache(self.pool) if enable_prefix_caching else NoPrefixCache()
        self._tables: dict[SequenceId, list[KVBlock]] = {}
        self._copies: list[tuple[int, int]] = []

    # -- introspection -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached free blocks included: they are evictable)."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (0.0 .. 1.0)."""
        return self.pool.usage

    @property
    def num_requests(self) -> int:
        """Requests holding a block table."""
        return len(self._tables)

    def block_ids(self, seq_id: SequenceId) -> list[int]:
        """A copy of the sequence's block table (empty when it holds none)."""
        return [b.block_id for b in self._tables.get(seq_id, ())]

    def tables(self) -> dict[SequenceId, list[int]]:
        """Every sequence's block table, as ids (a snapshot for checks and debugging)."""
        return {sid: [b.block_id for b in t] for sid, t in self._tables.items()}

    # -- allocation ------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The request's leading full blocks found in the prefix cache (empty when caching is off).

        For a request that holds no blocks (new or preempted). At least its last token is always
        left out, since the runner must compute it to get logits. A request that must compute its
        whole prompt (a mean-pooled embedding, prompt logprobs) gets none.
        """
        if request.seq_id in self._tables:
            raise ValueError(f"sequence {request.seq_id} already holds blocks")
        if request.computes_whole_prompt:
            return ComputedBlocks([], self.block_size)
        return ComputedBlocks(self._prefix.lookup(request), self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> list[int] | None:
        """Make the request's table cover ``num_computed_tokens + computed + num_new_tokens`` tokens.

        :param request: the request; its ``num_computed_tokens`` is read, never changed here.
        :param num_new_tokens: tokens the request computes this step.
        :param computed: prefix hits from ``get_computed_blocks``, only on the request's first
            allocation (they become the head of its table; the caller then advances
            ``num_computed_tokens`` past them).
        :return: the whole block table (ids), or ``None`` when there are not enough free blocks;
            then nothing changed.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        hits = computed.blocks if computed is not None else []
        table = self._tables.get(request.seq_id)
        if hits and (table or request.num_computed_tokens):
            raise ValueError(f"prefix hits given for sequence {request.seq_id}, which holds blocks")
        held = table if table is not None else []
        bs = self.block_size
        start = request.num_computed_tokens + len(hits) * bs
        num_held = len(held) + len(hits)
        num_new_blocks = max(0, _cdiv(start + num_new_tokens, bs) - num_held)
        # shared blocks in the write range need a private copy (only the last partial one after a fork)
        cow = [i for i in range(start // bs, len(held)) if held[i].ref_cnt > 1]
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks + len(cow) + num_evictable_hits > self.pool.num_free_blocks:
            return None

        if table is None:
            table = self._tables[request.seq_id] = []
        if hits:
            self.pool.touch(hits)  # before allocating, so no hit is popped as a "new" block
            table.extend(hits)
        for i in cow:
            old = table[i]
            (new,) = self.pool.allocate(1)
            table[i] = new
            self.pool.release([old])
            if i * bs < start:  # the block holds computed tokens the request keeps
                self._copies.append((old.block_id, new.block_id))
        table.extend(self.pool.allocate(num_new_blocks))
        return [b.block_id for b in table]

    def trim(self, request: Request) -> None:
        """Return the blocks past ``num_computed_tokens`` (the lookahead of draft tokens that were
        rejected), tail first, so the table covers exactly the computed tokens again."""
        table = self._tables.get(request.seq_id)
        keep = _cdiv(request.num_computed_tokens, self.block_size)
        if table is not None and len(table) > keep:
            unused = table[keep:]
            del table[keep:]
            self.pool.release(reversed(unused))

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks below ``num_computed_tokens`` in the prefix cache.

        Call after the step that computed them ran, so a hit never reads a block not yet written.
        """
        table = self._tables.get(request.seq_id)
        if table:
            self._prefix.register(request, table)

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's whole block table, adding one reference to each block."""
        if child.seq_id in self._tables:
            raise ValueError(f"sequence {child.seq_id} already holds blocks")
        table = self._tables.get(parent.seq_id)
        if table is None:
            raise ValueError(f"sequence {parent.seq_id} holds no blocks to fork")
        self.pool.touch(table)
        self._tables[child.seq_id] = list(table)
        self._prefix.fork(parent, child)

    def free(self, request: Request) -> None:
        """Drop the request's references, tail blocks first (they are then evicted first).

        Safe to call for a request that holds nothing.
        """
        table = self._tables.pop(request.seq_id, None)
        if table:
            self.pool.release(reversed(table))
        self._prefix.forget(request.seq_id)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` copy-on-write pairs recorded since the last call, in order."""
        copies, self._copies = self._copies, []
        return copies
