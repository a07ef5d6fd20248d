"""Phase policies: whether one step may mix prefill and decode work, and which phase runs when not.

Most backends run any mix of chunks in one forward (``MixedBatches``, the null policy: no phases).
A backend whose compiled graphs are specialised per phase (Gaudi's HPU graphs) declares
``mixed_batches=False``; the scheduler then asks ``AlternatingPhases`` which phase each step runs.

*Decode work* is a running request with exactly one token left to compute (``num_tokens -
num_computed_tokens == 1``); *prefill work* is a running request with more than one, or any waiting
request (new or preempted: it recomputes from token 0, and even one whose prefix hits leave a single
token is served by the prefill kernel, which takes any chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

from plinth.sched.request import Request

Phase = Literal["decode", "prefill"]
"""The kind of work a phased step runs."""

DECODE: Phase = "decode"
PREFILL: Phase = "prefill"


def has_decode_work(request: Request[Any]) -> bool:
    """True when the running ``request`` has exactly one token left to compute (a decode)."""
    return request.num_tokens - request.num_computed_tokens == 1


class PhasePolicy(Protocol):
    """Which phases a step tries, in order, and what a step that ran tells the policy."""

    def order(self, running: Sequence[Request[Any]], has_waiting: bool) -> tuple[Phase | None, ...]:
        """The phases to try this step, the preferred first: the scheduler stops at the first one
        that schedules or preempts something. ``None`` means "no phase: any mix"; an empty tuple
        means there is no work."""
        ...

    def ran(self, phase: Phase | None) -> None:
        """A non-empty step ran in ``phase``."""
        ...


class MixedBatches:
    """``mixed_batches=True``: one phase-less attempt per step, prefill and decode chunks together."""

    def order(self, running: Sequence[Request[Any]], has_waiting: bool) -> tuple[Phase | None, ...]:
        """Always ``(None,)``: no phases."""
        return (None,)

    def ran(self, phase: Phase | None) -> None:
        """Nothing to remember."""


class AlternatingPhases:
    """``mixed_batches=False``: each step runs decode work only or prefill work only.

    When only one kind of work exists, that kind runs. When both do, the step runs the phase the
    previous non-empty step did not, so neither starves: while prompts keep arriving, decodes still
    run at least every other step, and prompts at least every other step that can admit or advance
    one. A preferred phase that can do nothing (prefill preferred, but every prompt still waits for
    seats or blocks and no running request has prefill work) yields the step to the other phase at
    once instead of returning an empty step.
    """

    def __init__(self) -> None:
        self.previous: Phase | None = None  # the phase of the last non-empty step

    def order(self, running: Sequence[Request[Any]], has_waiting: bool) -> tuple[Phase | None, ...]:
        """The phases with work, the one the previous non-empty step did not run first."""
        decode = any(has_decode_work(r) for r in running)
        prefill = has_waiting or any(not has_decode_work(r) for r in running)
        if decode and prefill:
            return (DECODE, PREFILL) if self.previous == PREFILL else (PREFILL, DECODE)
        if decode:
            return (DECODE,)
        return (PREFILL,) if prefill else ()

    def ran(self, phase: Phase | None) -> None:
        """Remember the phase, for the alternation."""
        self.previous = phase
