"""``POST /v1/messages``: the Anthropic Messages API on the same engine (text only, one reply).

Streaming sends Anthropic's event sequence: ``message_start``, ``content_block_start``,
``content_block_delta``..., ``content_block_stop``, ``message_delta`` (stop reason, output tokens),
``message_stop``; an error after the stream started is an ``error`` event, then ``message_stop``.

A conversation that ends with an assistant turn is a prefill: the reply continues that text (and
holds only the continuation), as Anthropic's API does. ``/v1/messages/count_tokens`` counts the
prompt tokens of a request without running it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from plinth.runtime.outputs import CompletionOutput, RequestOutput
from plinth.sampling_params import SamplingParams
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
from plinth.validation import InvalidParameter

router = APIRouter()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Strict):
    """A text content block."""

    type: Literal["text"]
    text: Text
    cache_control: dict[str, Any] | None = Field(None, description="accepted and ignored")


class Message(_Strict):
    """One turn: ``content`` is a string or a list of text blocks."""

    role: Literal["user", "assistant"]
    content: Text | list[TextBlock]

    def text(self) -> str:
        """The turn's text (blocks joined)."""
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class CountTokensRequest(_Strict):
    """The body of ``POST /v1/messages/count_tokens``: a conversation, nothing to generate."""

    model: Text
    messages: list[Message] = Field(..., min_length=1)
    system: Text | list[TextBlock] | None = None

    def template_messages(self) -> list[dict[str, str]]:
        """The conversation as the chat template takes it, without a trailing assistant prefill."""
        turns = self.messages[:-1] if self.prefill is not None else self.messages
        msgs = [{"role": m.role, "content": m.text()} for m in turns]
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            msgs.insert(0, {"role": "system", "content": system})
        return msgs

    @property
    def prefill(self) -> str | None:
        """The text of a final assistant turn, which the reply continues; None without one."""
        last = self.messages[-1]
        return last.text() if last.role == "assistant" else None


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
        raise invalid_parameter(exc, {"stop": "stop_sequences"}) from None


async def _prompt(st: ServerState, body: CountTokensRequest) -> list[int]:
    """The prompt's token ids: the rendered conversation, continued by the prefill if there is one."""
    prefill = body.prefill
    if prefill is None:
        return await st.chat_prompt(body.template_messages())
    if prefill != prefill.rstrip():  # Anthropic's own rule: the model would continue after a space
        raise APIError(400, "the final assistant content cannot end with whitespace", param="messages")
    text: str = await asyncio.to_thread(st.tokenizer.apply_chat_template, body.template_messages())
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
    prompt = await _prompt(st, body)
    st.check_context(len(prompt), max_tokens, "messages", "max_tokens")
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
    cursor = ChoiceCursor(params.stop)
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
        yield event("message_stop", {})
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
