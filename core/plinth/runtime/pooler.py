"""The pooler: embedding requests' final hidden states, pooled per request across prefill chunks.

The runner hands it each step's hidden states (``[T, hidden]``, after the model's final norm) and the
chunks that name a :class:`~plinth.sched.request.Pool`; it keeps a float32 running sum per mean-pooled
request between chunks, and holds each request's finished vector until the engine takes it. It sees
value objects only (chunks, sequence ids), never a ``Request``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch

from plinth.sched.output import ScheduledChunk
from plinth.sched.request import Pooling, SequenceId


class Pooler:
    """Pooled vectors of embedding requests, built chunk by chunk (chunked prefill)."""

    def __init__(self) -> None:
        self._sums: dict[SequenceId, torch.Tensor] = {}  # mean pooling: float32 sum of the rows so far
        self._done: dict[SequenceId, torch.Tensor] = {}  # finished this step, until take()

    def pool(self, hidden: torch.Tensor, scheduled: Sequence[ScheduledChunk[Any]], pooling: list[int]) -> None:
        """Pool the chunks ``pooling`` indexes into ``scheduled``, whose tokens are the rows of
        ``hidden`` ([T, hidden], chunk after chunk in ``scheduled`` order).

        Mean pooling restarts at a chunk at position 0 (a preempted request recomputes its prompt
        from there; it never takes prefix hits, so every request's first chunk is at 0).
        """
        starts = list(accumulate((len(s.token_ids) for s in scheduled), initial=0))
        for i in pooling:
            chunk = scheduled[i]
            pool = chunk.pool
            assert pool is not None
            start, end = starts[i], starts[i + 1]
            if pool.pooling is Pooling.LAST:
                if pool.final:  # a copy: a step graph's output buffer is overwritten by the next replay
                    self._done[chunk.seq_id] = hidden[end - 1].to(torch.float32, copy=True)
                continue
            total = hidden[start:end].to(torch.float32).sum(0)  # [hidden]
            if chunk.start_position > 0:
                earlier = self._sums.pop(chunk.seq_id, None)
                if earlier is None:
                    raise RuntimeError(
                        f"sequence {chunk.seq_id}: a mean-pooled chunk at {chunk.start_position} "
                        "without the chunks before it"
                    )
                total += earlier
            if pool.final:
                self._done[chunk.seq_id] = total / (chunk.start_position + len(chunk.token_ids))
            else:
                self._sums[chunk.seq_id] = total

    def take(self) -> dict[SequenceId, torch.Tensor]:
        """The vectors (float32 ``[hidden]``) finished since the last call, by sequence id."""
        done, self._done = self._done, {}
        return done

    def forget(self, seq_id: SequenceId) -> None:
        """Drop what is kept for a sequence that finished or was aborted."""
        self._sums.pop(seq_id, None)
