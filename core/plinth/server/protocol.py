"""OpenAI request and response schemas (pydantic at the HTTP edge) and their mapping to SamplingParams.

Requests forbid unknown fields, so a misspelled option is a 400 naming it rather than silently
ignored. plinth's extra sampling options (``top_k``, ``min_p``, ...) are top-level fields, which is
how the ``openai`` client sends its ``extra_body``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from plinth.model.tokenizer import check_text
from plinth.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputs
from plinth.server.errors import APIError, invalid_parameter
from plinth.tools import Tool, call_constraint
from plinth.validation import InvalidParameter

# torch generators take seeds in [-2**63, 2**64): a larger one would fail inside the engine step
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
_INT32_MAX = 2**31 - 1
MAX_PROMPTS = 256  # prompts in one batched completion request

#: user text: a str that is valid Unicode (a lone surrogate, which JSON's "\ud800" allows, is a 400
#: naming the field here, instead of a TypeError in the tokenizer or when the answer is encoded)
Text = Annotated[str, AfterValidator(check_text)]
#: stop strings: the stream's holdback scans each against the text's end for every chunk, on the
#: event loop, so their number and length are bounded (OpenAI takes up to 4)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
StopText = Annotated[str, AfterValidator(check_text), Field(max_length=MAX_STOP_CHARS)]
StopList = Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)]
#: numbers and flags are taken as JSON gives them: "10", "yes" and true-as-1 are refused, not coerced
Int = StrictInt
Bool = StrictBool
Float = StrictFloat


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    include_usage: Bool = False
    continuous_usage_stats: Bool = Field(False, description="accepted and ignored")


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is always honoured here)."""

    name: Text = Field("response", max_length=64)
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema", description="the JSON schema")
    strict: Bool | None = Field(None, description="accepted; the schema is always enforced")

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    """``response_format``: plain text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only read with type 'json_schema', not {self.type!r}")
        return self


class StructuredOutputsFields(_Strict):
    """``structured_outputs`` (plinth's extra, vLLM's name): exactly one constraint."""

    json_: dict[str, Any] | Text | None = Field(None, alias="json", description="a JSON schema")
    json_object: Bool = False
    regex: Text | None = None
    choice: list[Text] | None = Field(None, max_length=1024)
    grammar: Text | None = Field(None, description="a Lark grammar (llguidance's dialect)")
    whitespace: Literal["compact", "flexible"] = "compact"

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class SamplingFields(_Strict):
    """Sampling fields shared by completions and chat: OpenAI's, then plinth's extras."""

    model: Text | None = Field(None, description="a served model name; omitted: the default one")
    n: Int = Field(1, ge=1, le=64, description="completions per prompt")
    temperature: Float | None = Field(None, ge=0.0, le=100.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    stop: StopText | StopList | None = None
    seed: Int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = Field(None, description="accepted and ignored")
    logit_bias: dict[str, Float] | None = Field(
        None, description="token id (as a string, as OpenAI's) -> bias in [-100, 100] added to its logit"
    )
    # sent by real clients (the openai SDK, langchain, litellm): accepted and ignored
    store: Bool | None = Field(None, description="accepted and ignored (nothing is stored)")
    service_tier: Text | None = Field(None, description="accepted and ignored")
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")
    # plinth extras (the openai client's extra_body)
    top_k: Int | None = Field(None, ge=-1, le=_INT32_MAX)
    min_p: Float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: Int = Field(0, ge=0, le=_INT32_MAX)
    ignore_eos: Bool = False
    stop_token_ids: list[Int] | None = Field(None, max_length=1024)
    include_stop_str_in_output: Bool = False
    skip_special_tokens: Bool = True
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema")
    structured_outputs: StructuredOutputsFields | None = Field(
        None, description="plinth's extra: one of json, json_object, regex, choice, grammar"
    )
    prompt_logprobs: Int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="vLLM's extra: each prompt token's logprob, rank and top-n"
    )

    @property
    def structured_param(self) -> str:
        """The field a constraint came from, for errors: ``structured_outputs`` or ``response_format``."""
        return "structured_outputs" if self.structured_outputs is not None else "response_format"

    def structured(self) -> tuple[StructuredOutputs, str] | None:
        """The constraint the request asks for and the field it came from; None for plain text."""
        rf = self.response_format
        if rf is not None and rf.type != "text" and self.structured_outputs is not None:
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        try:
            if self.structured_outputs is not None:
                so = self.structured_outputs
                spec = StructuredOutputs(
                    json=so.json_,
                    json_object=so.json_object,
                    regex=so.regex,
                    choice=so.choice,
                    grammar=so.grammar,
                    whitespace=so.whitespace,
                )
                return spec, "structured_outputs"
            if rf is None or rf.type == "text":
                return None
            if rf.type == "json_object":
                return StructuredOutputs(json_object=True), "response_format"
            assert rf.json_schema is not None
            return StructuredOutputs(json=rf.json_schema.schema_), "response_format"
        except InvalidParameter as exc:
            field = "structured_outputs" if self.structured_outputs is not None else "response_format"
            raise APIError(400, f"{field}: {exc.problem}", param=field) from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams; a rejected value is a 400 naming the field."""
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
            "structured": (spec[0] if (spec := self.structured()) else None),
            "prompt_logprobs": self.engine_prompt_logprobs,
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
            "logit_bias": self._logit_bias(),
        }
        fields.update({k: v for k, v in optional.items() if v is not None})
        try:
            return SamplingParams(**fields)
        except InvalidParameter as exc:
            raise invalid_parameter(exc, {"max_tokens": self._max_tokens_field}) from None

    def _logit_bias(self) -> dict[int, float] | None:
        """``logit_bias`` with its keys as token ids; a key that is not one is a 400."""
        if not self.logit_bias:
            return None
        out: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            text = key.strip()
            if not text.isascii() or not text.isdigit():
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
            out[int(text)] = bias
        return out

    @property
    def _max_tokens_field(self) -> str:
        return "max_tokens"

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The top-n the engine scores the prompt with (None: it does not score it)."""
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        """True when a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


# -- completions --------------------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a prompt (string, strings, token ids or lists of them)."""

    prompt: Text | list[Text] | list[Int] | list[list[Int]] = Field(..., description="one prompt or a batch")
    max_tokens: Int | None = Field(16, ge=1, le=_INT32_MAX)
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="top-n logprobs per token")
    echo: Bool = Field(False, description="prepend the prompt to the text")
    best_of: Int | None = Field(None, ge=1, description="not supported beyond n")
    suffix: Text | None = Field(None, description="not supported")

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

    @property
    def echo_logprobs(self) -> bool:
        """True when the prompt's tokens and logprobs come before the completion's (echo + logprobs)."""
        return self.echo and self.logprobs is not None

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, or ``logprobs`` with ``echo``: the larger when both are given."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob`` of a prompt position's token (the prompt's own or one of the top-n)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: vLLM's ``prompt_logprobs``: per prompt token, ``{token id: PromptLogprob}`` (None first)
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    """One completion of one prompt."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None


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
    text: Text


class FunctionCall(_Strict):
    """The function an assistant called: its name and JSON-encoded arguments."""

    name: Text
    arguments: Text


class ToolCall(_Strict):
    """A tool call of an earlier assistant turn (history sent back by the client)."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """One chat message; ``content`` is a string or a list of text parts.

    An assistant turn may carry the ``tool_calls`` it made, a ``tool`` turn the ``tool_call_id`` it
    answers (OpenAI's shape): both are passed to the chat template, which decides how to render them.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = Field(None, description="the participant's name (passed to the template)")
    tool_calls: list[ToolCall] | None = Field(None, validate_default=True)
    tool_call_id: Text | None = Field(None, validate_default=True)

    # field validators (not one on the model), so the error's param names the field
    @field_validator("tool_calls")
    @classmethod
    def _tool_calls_of_assistants(cls, value: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if value and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id_of_tools(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("role") == "tool" and not value:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return value

    def text(self) -> str:
        """The message's text (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as a chat template takes it (``developer`` is a system message)."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class FunctionDefinition(_Strict):
    """A function the model may call: OpenAI's ``tools[].function``."""

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="the arguments' JSON schema")
    strict: Bool | None = Field(None, description="accepted; required and named calls are always enforced")


class ChatTool(_Strict):
    """``tools[]``: a function tool."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Int | None = Field(None, ge=1, le=_INT32_MAX, description="deprecated: max_completion_tokens")
    max_completion_tokens: Int | None = Field(None, ge=1, le=_INT32_MAX)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: Bool = True
    tools: list[ChatTool] | None = Field(None, max_length=128, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: 'auto' with tools, 'none' without"
    )
    parallel_tool_calls: Bool = Field(True, description="False: at most one call per reply")
    reasoning_effort: Text | None = Field(None, description="accepted and ignored")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs: true")
        return value

    def check_supported(self) -> None:
        """Raise a 400 for OpenAI features plinth does not implement."""
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise APIError(400, "tools: two tools have the same name", param="tools")
        if choice is not None and choice != "none" and not self.tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(
                400, f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice"
            )
        if self.call_mode in ("required", "named") and self.structured() is not None:
            raise APIError(
                400, "a required tool call is a constraint of its own: drop response_format", param="tool_choice"
            )

    @property
    def tool_list(self) -> list[Tool]:
        """The request's tools (none when ``tool_choice`` is "none")."""
        if not self.tools or self.tool_choice == "none":
            return []
        return [Tool(t.function.name, t.function.description, t.function.parameters) for t in self.tools]

    @property
    def call_mode(self) -> str:
        """ "none", "auto", "required" or "named" (a function given by name)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def call_constraint(self) -> StructuredOutputs | None:
        """The grammar a required or named call imposes on the reply; None otherwise."""
        mode = self.call_mode
        if mode == "required":
            return call_constraint(self.tool_list, parallel=self.parallel_tool_calls)
        if mode == "named":
            assert isinstance(self.tool_choice, NamedToolChoice)
            return call_constraint(self.tool_list, name=self.tool_choice.function.name)
        return None

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template takes them (``developer`` is a system message)."""
        return [m.template_message() for m in self.messages]

    @property
    def max_tokens_param(self) -> str:
        """The name of the field the output limit came from (for errors)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def _max_tokens_field(self) -> str:
        return self.max_tokens_param

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
    """The assistant's reply: its text (None when it is only tool calls) and its calls."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


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
    prompt_logprobs: PromptLogprobs | None = None


# -- tokenizer and models -------------------------------------------------------------------------------


class TokenizeRequest(_Strict):
    """``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered with the template."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True

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

    model: Text | None = None
    tokens: list[Int] = Field(..., max_length=1 << 20)


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
    #: a LoRA adapter's base model (vLLM's field); None for the base model itself
    parent: str | None = None


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
