"""The value objects the scheduler hands to the model runner each step (no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

from plinth.sched.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes ``token_ids`` at positions ``start_position ..`` and writes their K/V into
    the slots ``block_ids`` gives. ``num_samples`` says how many tokens to sample from the logits
    of the last scheduled token: 0 for a prefill chunk that does not reach the end of the known
    tokens, 1 normally, ``n`` the first time a request with ``n`` > 1 samples (it then forks).
    """

    request: Request
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    num_samples: int


@dataclass(slots=True)
class SchedulerOutput:
    """What to run in one step."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the step
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """True when nothing is scheduled."""
        return not self.scheduled
