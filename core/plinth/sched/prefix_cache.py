"""Prefix caching: find a request's leading full blocks already in the pool; register new full ones.

A full block is named by a chained hash, ``sha256(parent_hash || token ids as little-endian int64)``,
so a block's hash commits to every token before it: two requests share block ``i`` only when their
first ``(i + 1) * block_size`` tokens are equal. sha256 over a fixed encoding is stable across
processes and machines (Python's ``hash`` is salted per process), which leaves room for sharing a
cache between processes later. Only FULL blocks are hashed; a partial block is never cached.

A request's LoRA adapter is the chain's extra key: the first block of a request with
``lora_id`` k > 0 chains from ``root_hash(k)``, not :data:`ROOT_HASH`, so (the hash being chained)
no block is ever shared between different adapters, or between an adapter and the base model.

``NoPrefixCache`` is the null implementation used when prefix caching is off, so the manager never
checks a flag.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from plinth.sched.block_pool import BlockHash, BlockPool, KVBlock
from plinth.sched.request import Request, SequenceId

ROOT_HASH: BlockHash = b"plinth-prefix-v1"
"""The parent hash of a sequence's first block."""


def root_hash(lora_id: int) -> BlockHash:
    """The parent hash of the first block of a request with LoRA adapter ``lora_id`` (0: none)."""
    if lora_id == 0:
        return ROOT_HASH
    return hashlib.sha256(ROOT_HASH + b"lora" + struct.pack("<q", lora_id)).digest()


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The chained hash of one full block: it commits to ``parent_hash`` and the block's tokens."""
    h = hashlib.sha256(parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class PrefixCache(Protocol):
    """What the KV cache manager asks of a prefix cache."""

    def lookup(self, request: Request) -> list[KVBlock]:
        """The longest run of cached blocks matching the request's leading full blocks.

        Capped so that at least one token is left to compute (the last token's logits are needed).
        """
        ...

    def register(self, request: Request, blocks: list[KVBlock]) -> None:
        """Cache the request's full blocks below ``request.num_computed_tokens`` not yet registered."""
        ...

    def fork(self, parent: Request, child: Request) -> None:
        """The child starts with the parent's hashes (same tokens so far)."""
        ...

    def forget(self, seq_id: SequenceId) -> None:
        """Drop what is kept for the sequence (it finished, was aborted or preempted)."""
        ...


class NoPrefixCache:
    """Prefix caching off: nothing is ever found or registered."""

    def lookup(self, request: Request) -> list[KVBlock]:
        """Always a miss."""
        return []

    def register(self, request: Request, blocks: list[KVBlock]) -> None:
        """Nothing to do."""

    def fork(self, parent: Request, child: Request) -> None:
        """Nothing to do."""

    def forget(self, seq_id: SequenceId) -> None:
        """Nothing to do."""


@dataclass(slots=True)
class _HashState:
    """A request's block hashes computed so far, and how many of its blocks were registered."""

    hashes: list[BlockHash] = field(default_factory=list)
    num_registered: int = 0


class HashPrefixCache:
    """Prefix caching by chained block hashes over the pool's hash -> block map.

    A request's hashes are computed lazily and kept until ``forget`` (its tokens only ever grow,
    so earlier hashes stay valid).
    """

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._states: dict[SequenceId, _HashState] = {}

    def _hash_upto(self, request: Request, state: _HashState, num_blocks: int) -> None:
        """Extend ``state.hashes`` to cover the request's first ``num_blocks`` full blocks."""
        hashes = state.hashes
        if len(hashes) >= num_blocks:
            return
        bs = self._pool.block_size
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else root_hash(request.lora_id)
        for i in range(len(hashes), num_blocks):
            parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)

    def lookup(self, request: Request) -> list[KVBlock]:
        """See ``PrefixCache.lookup``; stops at the first block that is not cached."""
        state = self._states.setdefault(request.seq_id, _HashState())
        bs = self._pool.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = state.hashes
        tokens = request.all_token_ids if len(hashes) < max_blocks else []
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            if i == len(hashes):  # hash lazily: an early miss saves hashing the rest
                parent = hashes[-1] if hashes else root_hash(request.lora_id)
                hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs]))
            block = self._pool.lookup(hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def register(self, request: Request, blocks: list[KVBlock]) -> None:
        """See ``PrefixCache.register``; a hash another block already holds is left to that block."""
        state = self._states.setdefault(request.seq_id, _HashState())
        num_full = min(request.num_computed_tokens // self._pool.block_size, len(blocks))
        if num_full <= state.num_registered:
            return
        self._hash_upto(request, state, num_full)
        for i in range(state.num_registered, num_full):
            block = blocks[i]
            if block.block_hash is None:
                self._pool.cache(block, state.hashes[i])
            else:
                assert block.block_hash == state.hashes[i], "a cached block changed owner tokens"
        state.num_registered = num_full

    def fork(self, parent: Request, child: Request) -> None:
        """See ``PrefixCache.fork``."""
        src = self._states.get(parent.seq_id)
        if src is not None:
            self._states[child.seq_id] = _HashState(list(src.hashes), src.num_registered)

    def forget(self, seq_id: SequenceId) -> None:
        """See ``PrefixCache.forget``."""
        self._states.pop(seq_id, None)

    @property
    def num_tracked_requests(self) -> int:
        """Requests with kept hashes (0 once every request is gone: nothing leaks)."""
        return len(self._states)
