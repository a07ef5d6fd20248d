"""OpenAI request and response schemas (pydantic at the HTTP edge) and their mapping to SamplingParams.

Requests forbid unknown fields, so a misspelled option is a 400 naming it rather than silently
ignored. plinth's extra sampling options (``top_k``, ``min_p``, ...) are top-level fields, which is
how the ``openai`` client sends its ``extra_body``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from plinth.sampling_params import MAX_LOGPROBS, SamplingParams
from plinth.server.errors import APIError, invalid_parameter
from plinth.validation import InvalidParameter

# torch generators take seeds in [-2**63, 2**64): a larger one would fail inside the engine step
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
_INT32_MAX = 2**31 - 1
MAX_PROMPTS = 256  # prompts in one batched completion request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    include_usage: bool = False


class SamplingFields(_Strict):
    """Sampling fields shared by completions and chat: OpenAI's, then plinth's extras."""

    model: str | None = Field(None, description="a served model name; omitted: the default one")
    n: int = Field(1, ge=1, le=64, description="completions per prompt")
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="accepted and ignored")
    logit_bias: dict[str, float] | None = Field(None, description="not supported: must be empty")
    # plinth extras (the openai client's extra_body)
    top_k: int | None = Field(None, ge=-1, le=_INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0, le=_INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=1024)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams; a rejected value is a 400 naming the field."""
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        fields: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "stop": self.stop,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "stop_token_ids": self.stop_token_ids,
        }
        fields.update({k: v for k, v in optional.items() if v is not None})
        try:
            return SamplingParams(**fields)
        except InvalidParameter as exc:
            raise invalid_parameter(exc) from None

    @property
    def include_usage(self) -> bool:
        """True when a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


# -- completions --------------------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a prompt (string, strings, token ids or lists of them)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(..., description="one prompt or a batch")
    max_tokens: int | None = Field(16, ge=1, le=_INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top-n logprobs per token")
    echo: bool = Field(False, description="prepend the prompt to the text")
    best_of: int | None = Field(None, ge=1, description="not supported beyond n")
    suffix: str | None = Field(None, description="not supported")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the batch, in order."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        if len(p) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(p)}", param="prompt")
        return list(p)  # type: ignore[arg-type]

    def check_supported(self) -> None:
        """Raise a 400 for OpenAI features plinth does not implement."""
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported (only best_of == n)", param="best_of")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported", param="echo")


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One completion of one prompt."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class Usage(BaseModel):
    """Token counts of a request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    """The body of a non-streaming ``/v1/completions`` answer."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# -- chat -----------------------------------------------------------------------------------------------


class TextPart(_Strict):
    """A text content part (the only kind plinth's text models take)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message; ``content`` is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message's text (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=_INT32_MAX, description="deprecated: max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, le=_INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = Field(None, description="only {'type': 'text'}")
    tools: list[dict[str, Any]] | None = Field(None, description="not supported")
    tool_choice: str | dict[str, Any] | None = Field(None, description="only 'none'")

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    def check_supported(self) -> None:
        """Raise a 400 for OpenAI features plinth does not implement."""
        if self.tools:
            raise APIError(400, "tools (function calling) are not supported", param="tools")
        if self.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice is not supported", param="tool_choice")
        if self.response_format and self.response_format.get("type") != "text":
            raise APIError(400, "only response_format {'type': 'text'} is supported", param="response_format")

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template takes them (``developer`` is a system message)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens``, or the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TopLogprob(BaseModel):
    """An alternative token at one position."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """A generated token with its alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat logprobs: one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    """The assistant's reply."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One reply."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    """The body of a non-streaming ``/v1/chat/completions`` answer."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


# -- tokenizer and models -------------------------------------------------------------------------------


class TokenizeRequest(_Strict):
    """``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _exactly_one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    """Token ids of the prompt."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Strict):
    """``POST /detokenize``: token ids to text."""

    model: str | None = None
    tokens: list[int] = Field(..., max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    """The text of the token ids."""

    prompt: str


class ModelCard(BaseModel):
    """One served model."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "plinth"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
