"""Requests as the scheduler sees them: token ids and counters, no tensors, no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    """Where a request is in its life. The ``FINISHED_*`` members are terminal."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"  # stop token, eos or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length reached
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        """True for the terminal states."""
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason ("stop", "length", "abort"), None while unfinished."""
        return self.value if self.finished else None


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED})


@dataclass(slots=True)
class StopCriteria:
    """The stop conditions the scheduler checks itself (stop strings need text: the engine's job)."""

    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    There is no prefill or decode phase: ``num_computed_tokens`` (tokens whose K/V are in the cache)
    catches up to ``num_tokens`` (prompt + output). A request asked for ``n`` > 1 completions is
    scheduled alone until its prompt is computed, then forked into ``n`` sequences that share the
    prompt's blocks (``sample_index`` tells them apart; the first keeps this request's id).
    """

    request_id: str
    prompt_token_ids: list[int]
    stop: StopCriteria
    n: int = 1
    sample_index: int = 0
    parent_id: str | None = None
    params: object = None  # the engine's SamplingParams, opaque here
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hits at the first schedule
    status: RequestStatus = RequestStatus.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    forked: bool = False  # True once forked into n sequences (and for the forks): never fork again

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        """True once the request reached a terminal state."""
        return self.status.finished
