"""``POST /v1/messages``: the Anthropic Messages API on the same engine (text and tool use, one reply).

Streaming sends Anthropic's event sequence: ``message_start``, ``content_block_start``,
``content_block_delta``..., ``content_block_stop``, ``message_delta`` (stop reason, output tokens),
``message_stop``; an error after the stream started is an ``error`` event, then ``message_stop``.

With ``tools``, the reply's ``<tool_call>`` blocks (:mod:`plinth.tools`) come back as ``tool_use``
blocks (streamed as ``input_json_delta``), ``stop_reason`` "tool_use"; ``tool_choice`` ``any`` or
``tool`` constrains the reply to calls. Earlier ``tool_use`` and ``tool_result`` blocks are handed to
the chat template as OpenAI-style calls and tool turns.

A conversation that ends with an assistant turn is a prefill: the reply continues that text (and
holds only the continuation), as Anthropic's API does. ``/v1/messages/count_tokens`` counts the
prompt tokens of a request without running it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from plinth.runtime.outputs import CompletionOutput, RequestOutput
from plinth.sampling_params import SamplingParams, StructuredOutputs
from plinth.server.errors import APIError, as_api_error, error_body, invalid_parameter
from plinth.server.openapi import ERRORS
from plinth.server.protocol import Bool, Float, Int, StopList, Text
from plinth.server.state import ServerState, engine_outputs, get_state
from plinth.server.streams import (
    ChoiceCursor,
    ClientDisconnected,
    Streams,
    close_all,
    collect,
    merge,
    sse,
    start_streams,
)
from plinth.tools import Tool, ToolCall, ToolCallStream, call_constraint, chat_messages, parse_tool_calls
from plinth.validation import InvalidParameter

router = APIRouter()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Strict):
    """A text content block."""

    type: Literal["text"]
    text: Text
    cache_control: dict[str, Any] | None = Field(None, description="accepted and ignored")


class ToolUseBlock(_Strict):
    """A call the assistant made (history sent back by the client)."""

    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = Field(None, description="accepted and ignored")
    # the anthropic SDK's ToolUseBlock has these; a client echoing a reply's blocks sends them back
    caller: dict[str, Any] | None = Field(None, description="accepted and ignored")
    toolset_name: Text | None = Field(None, description="accepted and ignored")


class ToolResultBlock(_Strict):
    """The result of a call, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: Bool = False
    cache_control: dict[str, Any] | None = Field(None, description="accepted and ignored")

    def text(self) -> str:
        """The result's text (blocks joined), marked when the call failed."""
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Strict):
    """One turn: ``content`` is a string or a list of blocks (text, tool_use, tool_result)."""

    role: Literal["user", "assistant"]
    content: Text | list[Block]

    def text(self) -> str:
        """The turn's text (its text blocks joined)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))

    def template_messages(self) -> list[dict[str, Any]]:
        """The turn as chat-template messages: tool results become ``tool`` turns, calls an
        assistant's ``tool_calls`` (OpenAI's shape, which :func:`plinth.tools.chat_messages` reads)."""
        blocks = [] if isinstance(self.content, str) else self.content
        out: list[dict[str, Any]] = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
            for b in blocks
            if isinstance(b, ToolResultBlock)
        ]
        msg: dict[str, Any] = {"role": self.role, "content": self.text()}
        calls = [b for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            msg["tool_calls"] = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                for b in calls
            ]
        if msg["content"] or calls or not out:
            out.append(msg)
        return out


class AnthropicTool(_Strict):
    """``tools[]``: a client tool."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = Field(None, description="accepted and ignored")


class ToolChoice(_Strict):
    """``tool_choice``: ``auto`` (the model decides), ``any`` (some call), ``tool`` (this one), ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: Bool = False


class CountTokensRequest(_Strict):
    """The body of ``POST /v1/messages/count_tokens``: a conversation, nothing to generate."""

    model: Text
    messages: list[Message] = Field(..., min_length=1)
    system: Text | list[TextBlock] | None = None

    tools: list[AnthropicTool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation as the chat template takes it, without a trailing assistant prefill."""
        turns = self.messages[:-1] if self.prefill is not None else self.messages
        msgs = [m for turn in turns for m in turn.template_messages()]
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            msgs.insert(0, {"role": "system", "content": system})
        return msgs

    @property
    def prefill(self) -> str | None:
        """The text of a final assistant turn, which the reply continues; None without one."""
        last = self.messages[-1]
        if last.role != "assistant" or (not isinstance(last.content, str) and any(
            not isinstance(b, TextBlock) for b in last.content
        )):  # fmt: skip
            return None
        return last.text()

    @property
    def tool_list(self) -> list[Tool]:
        """The tools the model may call (none when ``tool_choice`` is "none")."""
        if not self.tools or (self.tool_choice is not None and self.tool_choice.type == "none"):
            return []
        return [Tool(t.name, t.description, t.input_schema) for t in self.tools]

    def check_tools(self) -> None:
        """400s for a tool_choice that names no tool, or tools with one name twice."""
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise APIError(400, "tools: two tools have the same name", param="tools")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise APIError(400, f"tool_choice {choice.type!r} needs tools", param="tool_choice")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise APIError(400, f"tool_choice names {choice.name!r}, which is not in tools", param="tool_choice")

    def call_constraint(self) -> StructuredOutputs | None:
        """The grammar of ``any`` and ``tool``: the reply is calls only."""
        choice = self.tool_choice
        if choice is None or choice.type in ("auto", "none") or not self.tools:
            return None
        name = choice.name if choice.type == "tool" else None
        return call_constraint(self.tool_list, name=name, parallel=not choice.disable_parallel_tool_use)


class MessagesRequest(CountTokensRequest):
    """The body of ``POST /v1/messages``."""

    max_tokens: Int = Field(..., ge=1, le=2**31 - 1)
    stop_sequences: StopList | None = None
    temperature: Float | None = Field(None, ge=0.0, le=1.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=0, le=2**31 - 1)
    stream: Bool = False
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")


class Usage(BaseModel):
    """Token counts."""

    input_tokens: int
    output_tokens: int


class TextContent(BaseModel):
    """The reply's text block."""

    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    """A call in the reply."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessagesResponse(BaseModel):
    """The body of a non-streaming ``/v1/messages`` answer."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextContent | ToolUseContent]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: Usage


def _stop(c: CompletionOutput) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished completion."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return ("end_turn", None) if c.finish_reason == "stop" else (c.finish_reason, None)


def _params(st: ServerState, body: MessagesRequest) -> SamplingParams:
    fields: dict[str, Any] = {"max_tokens": st.max_tokens(body.max_tokens), "stop": body.stop_sequences}
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    try:
        return SamplingParams(**fields)
    except InvalidParameter as exc:
        raise invalid_parameter(exc, {"stop": "stop_sequences"}) from None


async def _prompt(st: ServerState, body: CountTokensRequest) -> list[int]:
    """The prompt's token ids: the rendered conversation, continued by the prefill if there is one."""
    prefill = body.prefill
    messages, template_vars = chat_messages(body.template_messages(), body.tool_list, st.tokenizer.chat_template)
    if prefill is None:
        return await st.chat_prompt(messages, template_vars=template_vars)
    if prefill != prefill.rstrip():  # Anthropic's own rule: the model would continue after a space
        raise APIError(400, "the final assistant content cannot end with whitespace", param="messages")
    text: str = await asyncio.to_thread(lambda: st.tokenizer.apply_chat_template(messages, **template_vars))
    return await st.encode(text + prefill, "messages", add_special_tokens=False)


class TokenCount(BaseModel):
    """The answer of ``/v1/messages/count_tokens``."""

    input_tokens: int


@router.post("/v1/messages/count_tokens", response_model=TokenCount, responses=ERRORS)
async def count_tokens(body: CountTokensRequest, request: Request) -> TokenCount:
    """The number of prompt tokens ``body`` would take."""
    st = get_state(request)
    st.model_name(body.model)
    return TokenCount(input_tokens=len(await _prompt(st, body)))


@router.post("/v1/messages", response_model=MessagesResponse, responses=ERRORS)
async def create_message(body: MessagesRequest, request: Request) -> Response | MessagesResponse:
    """Anthropic Messages: a conversation in, one assistant text block out."""
    st = get_state(request)
    model = st.model_name(body.model)
    max_tokens = st.max_tokens(body.max_tokens)
    params = _params(st, body)
    body.check_tools()
    if (calls_only := body.call_constraint()) is not None:
        await st.check_structured(calls_only, "tools")
        params = dataclasses.replace(params, structured=calls_only)
    tools = body.tool_list
    prompt = await _prompt(st, body)
    st.check_context(len(prompt), max_tokens, "messages", "max_tokens")
    msg_id = f"msg_{uuid.uuid4().hex}"
    streams: Streams = {0: engine_outputs(st, msg_id, prompt, params, st.lora_for(model))}
    if body.stream:
        firsts = await start_streams(streams)
        gen = _stream(params, tools, msg_id, model, firsts, streams)
        return StreamingResponse(gen, media_type="text/event-stream")
    try:
        out = (await collect(request, streams))[0]
    except ClientDisconnected:
        return Response(status_code=499)
    c = out.outputs[0]
    stop_reason, stop_sequence = _stop(c)
    content: list[TextContent | ToolUseContent] = [TextContent(text=c.text)]
    if tools:
        text, calls = parse_tool_calls(c.text, tools)
        if calls:
            content = [TextContent(text=text)] if text else []
            content += [_tool_use(call) for call in calls]
            stop_reason = "tool_use" if stop_reason == "end_turn" else stop_reason
    return MessagesResponse(
        id=msg_id,
        model=model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=Usage(input_tokens=len(out.prompt_token_ids), output_tokens=len(c.token_ids)),
    )


def _tool_use(call: ToolCall) -> ToolUseContent:
    return ToolUseContent(id="toolu_" + call.id.removeprefix("call_"), name=call.name, input=json.loads(call.arguments))


async def _stream(
    params: SamplingParams,
    tools: list[Tool],
    msg_id: str,
    model: str,
    firsts: dict[int, RequestOutput],
    streams: Streams,
) -> AsyncIterator[str]:
    def event(name: str, data: dict[str, Any]) -> str:
        return sse({"type": name, **data}, event=name)

    message: dict[str, Any] = {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": len(firsts[0].prompt_token_ids), "output_tokens": 0},
    }
    yield event("message_start", {"message": message})
    cursor = ChoiceCursor(params.stop)
    split = ToolCallStream(tools) if tools else None
    blocks = 0  # content blocks started
    text_open = False  # the last block started is a text block still open
    last: CompletionOutput | None = None
    try:
        async for _, out in merge(firsts, streams):
            last = out.outputs[0]
            delta = cursor.advance(last)
            if delta is None:
                continue
            text, calls = (delta.text, []) if split is None else split.feed(delta.text, final=last.finished)
            if text:
                if not text_open:
                    yield event("content_block_start", {"index": blocks, "content_block": {"type": "text", "text": ""}})
                    blocks, text_open = blocks + 1, True
                yield event("content_block_delta", {"index": blocks - 1, "delta": {"type": "text_delta", "text": text}})
            for call in calls:  # each call whole: its block, its input in one piece, its end
                if text_open:
                    yield event("content_block_stop", {"index": blocks - 1})
                    text_open = False
                use = _tool_use(call)
                start = {"type": "tool_use", "id": use.id, "name": use.name, "input": {}}
                yield event("content_block_start", {"index": blocks, "content_block": start})
                partial = {"type": "input_json_delta", "partial_json": call.arguments}
                yield event("content_block_delta", {"index": blocks, "delta": partial})
                yield event("content_block_stop", {"index": blocks})
                blocks += 1
    except Exception as exc:  # noqa: BLE001 - the response has started: report in-band
        err = as_api_error(exc)
        yield event("error", error_body(err.status, err.message, err.param, err.type))
        yield event("message_stop", {})
        return
    finally:
        await close_all(streams.values())
    if blocks == 0:  # an empty reply still has its (empty) text block
        yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        blocks, text_open = 1, True
    if text_open:
        yield event("content_block_stop", {"index": blocks - 1})
    stop_reason, stop_sequence = _stop(last) if last is not None else (None, None)
    if split is not None and split.num_calls and stop_reason == "end_turn":
        stop_reason = "tool_use"
    yield event(
        "message_delta",
        {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": cursor.tokens},
        },
    )
    yield event("message_stop", {})
