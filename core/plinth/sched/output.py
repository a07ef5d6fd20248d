"""The value objects the scheduler exchanges with the runner and the engine each step (no tensors).

Out of ``Scheduler.schedule``: a :class:`SchedulerOutput` of :class:`ScheduledChunk` items, each
naming its sequence and the samples to take. Back from the engine: sampled tokens keyed by
:class:`~plinth.sched.request.SequenceId` (``Scheduler.update``), and the finishes the engine decides
itself in one :class:`EngineFinishes` (``Scheduler.finish``). Nothing here is a live ``Request``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic

from plinth.sched.request import P, Pool, PromptTargets, Sample, SequenceId


@dataclass(slots=True)
class ScheduledChunk(Generic[P]):
    """One sequence's share of a step.

    The runner computes ``token_ids`` at positions ``start_position ..`` and writes their K/V into
    the slots ``block_ids`` gives. ``samples`` lists the tokens to sample from the logits of the last
    scheduled token: none for a prefill chunk that does not reach the end of the known tokens, the
    sequence's own sample normally, and ``n`` (sequence ids ``(request_id, 0 .. n-1)``) the first
    time a request with ``n`` > 1 samples: it then forks into those sequences. An embedding
    request's chunk samples nothing and names its ``pool`` instead (None for every other chunk).

    ``draft_token_ids`` (speculative decoding; ``plinth.sched.draft``) are the last tokens of
    ``token_ids``, proposed rather than known: the sequence's own sample is then taken from the
    logits of every one of its last ``1 + len(draft_token_ids)`` tokens, to verify the drafts.

    ``prompt_targets`` (prompt logprobs): the prompt tokens the chunk's first rows predict; the
    runner scores those rows too (None for every other chunk: they cost nothing extra).

    ``lora_id``: the sequence's LoRA adapter (0: none; the runner maps it to an adapter slot).
    """

    seq_id: SequenceId
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    samples: tuple[Sample[P], ...]
    pool: Pool | None = None
    draft_token_ids: list[int] = field(default_factory=list)
    prompt_targets: PromptTargets | None = None
    lora_id: int = 0

    @property
    def num_samples(self) -> int:
        """How many tokens to sample after this chunk."""
        return len(self.samples)


@dataclass(slots=True)
class SchedulerOutput(Generic[P]):
    """What to run in one step.

    ``finished_seq_ids`` lists the sequences that finished (any reason) since the previous step
    that scheduled something: the runner drops what it keeps per sequence (seeded generators),
    the way vLLM v1 passes ``finished_req_ids``.
    """

    scheduled: list[ScheduledChunk[P]]
    num_batched_tokens: int
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the step
    preempted_ids: list[SequenceId] = field(default_factory=list)
    finished_seq_ids: list[SequenceId] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """True when nothing is scheduled."""
        return not self.scheduled


@dataclass(slots=True)
class EngineFinishes:
    """The finishes the engine decides itself, handed to ``Scheduler.finish`` in one value object.

    :param stopped: sequences whose text reached a stop string (the scheduler sees no text).
    :param aborted: user request ids to abort, every sequence of each (waiting, running or forked).
    """

    stopped: list[SequenceId] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        """True when there is anything to finish."""
        return bool(self.stopped or self.aborted)
