"""Sampling parameters: validated at the edge, so bad input gets a message naming the field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: The most logprobs a request may ask for per token.
MAX_LOGPROBS = 20


class SamplingParams(BaseModel):
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``top_k == 0`` (or -1) and ``top_p == 1`` disable those filters.
    Penalties follow the OpenAI definitions (presence, frequency: subtracted from the logits of
    tokens already generated) and the CTRL/Hugging Face one (repetition: divides positive and
    multiplies negative logits of tokens in the prompt or the output).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(1, ge=1, le=64, description="completions per prompt; they share the prompt's KV blocks")
    max_tokens: int | None = Field(16, ge=1, description="new tokens at most; None: up to the context length")
    min_tokens: int = Field(0, ge=0, description="stop conditions are ignored before this many tokens")
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=-1, description="keep the k most likely tokens; 0 or -1: all")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(
        None, ge=-(2**63), lt=2**64, description="per-request seed: the same seed gives the same tokens"
    )
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: list[str] = Field(default_factory=list, description="stop strings (not included in the text)")
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top-n logprobs per token")
    skip_special_tokens: bool = True

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k_disabled(cls, value: int) -> int:
        return 0 if value == -1 else value

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
