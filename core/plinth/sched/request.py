"""Requests as the scheduler sees them: token ids and counters, no tensors, no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

P = TypeVar("P")  # the sampling parameters: the engine's type, opaque to the scheduler


class SequenceId(NamedTuple):
    """Names one sequence: sample ``sample_index`` of user request ``request_id``.

    Only ``sched`` mints these (sample 0 for a new ``Request``, ``1 .. n-1`` when the scheduler forks
    it); every other layer uses them as opaque keys, and never builds or parses a string for one. A
    named tuple hashes and compares in C: the step loop keys a few dicts by it for every sequence.
    """

    request_id: str
    sample_index: int

    def __str__(self) -> str:
        """``'a'`` for sample 0, ``'a' sample 2`` for a fork (error messages only; never parsed)."""
        return repr(self.request_id) if self.sample_index == 0 else f"{self.request_id!r} sample {self.sample_index}"


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


class Pooling(enum.Enum):
    """How an embedding request's prompt becomes one vector (the runner pools; the scheduler only
    needs to know that MEAN must compute every prompt token: no prefix-cache hits for it)."""

    LAST = "last"  # the final prompt token's hidden state
    MEAN = "mean"  # the average over every prompt token's


@dataclass(frozen=True, slots=True)
class Pool:
    """What the runner does with an embedding request's chunk, in place of sampling.

    ``final``: the chunk ends the prompt, so the embedding is complete after this step (and the
    scheduler finishes the request in ``update``).
    """

    pooling: Pooling
    final: bool


@dataclass(frozen=True, slots=True)
class PromptTargets:
    """The prompt tokens a chunk's rows predict, for a request that asked for prompt logprobs.

    Row ``i`` of the chunk (position ``start_position + i``) is scored against ``token_ids[i]``,
    the prompt token after it; a chunk that reaches the prompt's last token has one target fewer
    than rows (that row predicts the first output). ``top``: alternatives to report per position.
    """

    top: int
    token_ids: list[int]


@dataclass(slots=True)
class StopCriteria:
    """The stop conditions the scheduler checks itself (stop strings need text: the engine's job)."""

    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Sample(Generic[P]):
    """One token to sample at the end of a scheduled chunk, for sequence ``seq_id``.

    ``seed`` seeds the sequence's own generator the first time it samples (None: unseeded);
    ``prompt_token_ids`` and ``output_token_ids`` are the sequence's own lists (for penalties), read
    only and valid until ``Scheduler.update`` appends the step's tokens.
    """

    seq_id: SequenceId
    params: P
    seed: int | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass(slots=True, eq=False)
class Request(Generic[P]):
    """One sequence being generated.

    There is no prefill or decode phase: ``num_computed_tokens`` (tokens whose K/V are in the cache)
    catches up to ``num_tokens`` (prompt + output). A request asked for ``n`` > 1 completions is
    scheduled alone until its prompt is computed, then forked into ``n`` sequences that share the
    prompt's blocks and its ``request_id``; ``sample_index`` tells them apart, and ``seq_id`` names
    each. ``seed`` (None: unseeded) is the request's; sample ``k`` seeds with ``seed + k``.

    An *embedding request* (``pooling`` set) samples nothing: its chunks carry a :class:`Pool`
    instead of samples, it holds only its prompt's blocks, and it finishes (``FINISHED_STOPPED``)
    in the ``update`` after its last prompt token was computed.

    ``prompt_logprobs`` (None: off) asks the runner to score every prompt token with ``top``
    alternatives: until the request has sampled, its chunks carry :class:`PromptTargets` and it
    takes no prefix-cache hits (a hit skips the positions to score).

    ``lora_id`` names the LoRA adapter the request runs with (0: none): an opaque int the engine
    mints per loaded adapter and never reuses, so the prefix cache keeps each adapter's blocks apart.
    """

    request_id: str
    prompt_token_ids: list[int]
    stop: StopCriteria
    params: P = field(kw_only=True)  # the engine's sampling parameters, passed through to the runner
    seed: int | None = None
    n: int = 1
    sample_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)  # appended to, never replaced: samples hold it
    num_computed_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prefix-cache hits at the first schedule
    status: RequestStatus = RequestStatus.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    forked: bool = False  # True once forked into n sequences (and for the forks): never fork again
    pooling: Pooling | None = field(default=None, kw_only=True)  # set: an embedding request
    prompt_logprobs: int | None = field(default=None, kw_only=True)  # set: score the prompt (top-n)
    lora_id: int = field(default=0, kw_only=True)  # the adapter (0: none); its blocks are its own
    seq_id: SequenceId = field(init=False)
    samples: tuple[Sample[P]] = field(init=False)  # the one sample it takes each step, built once

    def __post_init__(self) -> None:
        self.seq_id = SequenceId(self.request_id, self.sample_index)
        self.samples = (self.make_sample(self.sample_index),)

    def make_sample(self, index: int) -> Sample[P]:
        """Sample ``index`` of this request's tokens: its sequence id and its seed (``seed + index``).

        ``index`` is this sequence's own ``sample_index`` for the sample it takes each step, or
        ``1 .. n-1`` for the first tokens of the forks at the step that forks it.
        """
        seed = None if self.seed is None else self.seed + index
        return Sample(
            SequenceId(self.request_id, index), self.params, seed, self.prompt_token_ids, self.output_token_ids
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def computes_whole_prompt(self) -> bool:
        """True when every prompt position must be computed, so no prefix-cache hit may skip one: a
        mean-pooled embedding, or prompt logprobs not scored yet (they are, once it sampled)."""
        if self.pooling is Pooling.MEAN:
            return True
        return self.prompt_logprobs is not None and not self.output_token_ids

    def prompt_targets(self, start: int, end: int) -> PromptTargets | None:
        """What a chunk over positions ``start .. end - 1`` scores: None when the request does not
        ask for prompt logprobs, has sampled (they are done), or the chunk has no prompt token to
        predict (it starts at the prompt's last token or after)."""
        prompt = self.prompt_token_ids
        if self.prompt_logprobs is None or self.output_token_ids or start + 1 >= len(prompt):
            return None
        return PromptTargets(self.prompt_logprobs, prompt[start + 1 : min(end + 1, len(prompt))])

    @property
    def is_finished(self) -> bool:
        """True once the request reached a terminal state."""
        return self.status.finished
