"""``POST /v1/messages``: the Anthropic Messages API on the same engine (text only, one reply).

Streaming sends Anthropic's event sequence: ``message_start``, ``content_block_start``,
``content_block_delta``..., ``content_block_stop``, ``message_delta`` (stop reason, output tokens),
``message_stop``; an error after the stream started is an ``error`` event.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from plinth.runtime.outputs import CompletionOutput, RequestOutput
from plinth.sampling_params import SamplingParams
from plinth.server.app import ServerState, get_state
from plinth.server.errors import as_api_error, error_body, invalid_parameter
from plinth.server.openai_api import chat_prompt, engine_outputs
from plinth.server.streams import (
    ChoiceCursor,
    ClientDisconnected,
    Streams,
    close_all,
    collect,
    merge,
    sse,
    start_streams,
    stop_holdback,
)
from plinth.validation import InvalidParameter

router = APIRouter()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Strict):
    """A text content block."""

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = Field(None, description="accepted and ignored")


class Message(_Strict):
    """One turn: ``content`` is a string or a list of text blocks."""

    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    def text(self) -> str:
        """The turn's text (blocks joined)."""
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class MessagesRequest(_Strict):
    """The body of ``POST /v1/messages``."""

    model: str
    max_tokens: int = Field(..., ge=1, le=2**31 - 1)
    messages: list[Message] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=2**31 - 1)
    stream: bool = False
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")

    def template_messages(self) -> list[dict[str, str]]:
        """The conversation as the chat template takes it."""
        msgs = [{"role": m.role, "content": m.text()} for m in self.messages]
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            msgs.insert(0, {"role": "system", "content": system})
        return msgs


class Usage(BaseModel):
    """Token counts."""

    input_tokens: int
    output_tokens: int


class TextContent(BaseModel):
    """The reply's text block."""

    type: Literal["text"] = "text"
    text: str


class MessagesResponse(BaseModel):
    """The body of a non-streaming ``/v1/messages`` answer."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextContent]
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
        raise invalid_parameter(exc) from None


@router.post("/v1/messages", response_model=MessagesResponse)
async def create_message(body: MessagesRequest, request: Request) -> Response | MessagesResponse:
    """Anthropic Messages: a conversation in, one assistant text block out."""
    st = get_state(request)
    model = st.model_name(body.model)
    params = _params(st, body)
    prompt = await chat_prompt(st, body.template_messages())
    msg_id = f"msg_{uuid.uuid4().hex}"
    streams: Streams = {0: engine_outputs(st, msg_id, prompt, params)}
    if body.stream:
        firsts = await start_streams(streams)
        return StreamingResponse(_stream(params, msg_id, model, firsts, streams), media_type="text/event-stream")
    try:
        out = (await collect(request, streams))[0]
    except ClientDisconnected:
        return Response(status_code=499)
    c = out.outputs[0]
    stop_reason, stop_sequence = _stop(c)
    return MessagesResponse(
        id=msg_id,
        model=model,
        content=[TextContent(text=c.text)],
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=Usage(input_tokens=len(out.prompt_token_ids), output_tokens=len(c.token_ids)),
    )


async def _stream(
    params: SamplingParams, msg_id: str, model: str, firsts: dict[int, RequestOutput], streams: Streams
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
    yield event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    cursor = ChoiceCursor(stop_holdback(params.stop))
    last: CompletionOutput | None = None
    try:
        async for _, out in merge(firsts, streams):
            last = out.outputs[0]
            delta = cursor.advance(last)
            if delta is not None and delta.text:
                yield event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": delta.text}})
    except Exception as exc:  # noqa: BLE001 - the response has started: report in-band
        err = as_api_error(exc)
        yield event("error", error_body(err.status, err.message, err.param, err.type))
        return
    finally:
        await close_all(streams.values())
    yield event("content_block_stop", {"index": 0})
    stop_reason, stop_sequence = _stop(last) if last is not None else (None, None)
    yield event(
        "message_delta",
        {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": cursor.tokens},
        },
    )
    yield event("message_stop", {})
