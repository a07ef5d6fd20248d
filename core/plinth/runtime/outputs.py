"""What the engine hands back: per-request outputs with text, token ids, logprobs and metrics (or,
for an embedding request, its vector)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (``time.monotonic()``) and counts of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None  # the first step that ran any of its tokens
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to the first step that ran any of the request's tokens."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Generated tokens per second after the first one (the decode speed)."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generated_tokens < 2:
            return None
        span = self.last_token_time - self.first_token_time
        return (self.num_generated_tokens - 1) / span if span > 0 else None


@dataclass(slots=True)
class TokenLogprob:
    """The logprob of a token and the top-n alternatives at its position.

    ``rank``: where the token stands in the model's distribution (1 = the most likely); set for
    prompt logprobs (vLLM reports it there), None for generated tokens.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        """True once this completion ended."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after a step: all its completions so far.

    An embedding request has one output, finished, with no completions and its ``embedding``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    finished: bool = False
    error: str | None = None
    extra: dict[str, object] = field(default_factory=dict)
    embedding: list[float] | None = None  # an embedding request's vector (float32 values)
    #: with ``SamplingParams.prompt_logprobs``: one entry per prompt token, None for the first
    #: (nothing predicts it); None when not asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """One input's embedding, as ``LLM.embed`` returns it.

    ``embedding``: the pooled vector (float32 values as Python floats; unit L2 norm when normalised);
    ``num_prompt_tokens``: the tokens the input counted (its usage).
    """

    embedding: list[float]
    num_prompt_tokens: int
