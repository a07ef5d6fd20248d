"""``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming (SSE) and not.

Each prompt of a request is one engine request (``n`` completions each); choice ``k`` of prompt ``i``
has index ``i * n + k``, as OpenAI numbers them. Streams are primed before the response starts, so
a refused request gets its HTTP status; an error after that is sent as a last ``data: {"error": ...}``
event before ``data: [DONE]``.
"""

from __future__ import annotations

import codecs
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from plinth.runtime.outputs import RequestOutput, TokenLogprob
from plinth.sampling_params import SamplingParams
from plinth.server.errors import APIError, as_api_error, error_body
from plinth.server.openapi import ERRORS
from plinth.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
    Usage,
)
from plinth.server.protocol import FunctionCall as FunctionCallModel
from plinth.server.protocol import ToolCall as ToolCallModel
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
from plinth.tools import ToolCall, ToolCallStream, chat_messages, parse_tool_calls

router = APIRouter()

_DONE = "data: [DONE]\n\n"


def _usage(outs: dict[int, RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outs.values())
    completion = sum(len(c.token_ids) for o in outs.values() for c in o.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _usage_from_counts(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_logprobs(
    st: ServerState, lps: Iterable[tuple[int, TokenLogprob | None]], offset: int, top_n: int | None = None
) -> CompletionLogprobs:
    """Legacy logprobs of ``(token id, its logprob)`` pairs (None: an unscored token, the prompt's
    first); ``offset``: the character where the first token starts; ``top_n``: alternatives shown
    (None: all there are). A token that ends inside a multi-byte character is shown as OpenAI does
    (``"\\xf0\\x9f"``); offsets count the characters completed before each token."""
    tok = st.tokenizer
    chars = codecs.getincrementaldecoder("utf-8")("replace")
    out = CompletionLogprobs()
    for token_id, lp in lps:
        out.tokens.append(tok.token_string(token_id))
        out.token_logprobs.append(None if lp is None else lp.logprob)
        out.top_logprobs.append(None if lp is None else {tok.token_string(t): v for t, v in lp.top[:top_n]})
        out.text_offset.append(offset)
        offset += len(chars.decode(tok.token_bytes(token_id)))
    return out


def _dump(scored: PromptLogprobs | None) -> list[dict[str, Any] | None] | None:
    """``prompt_logprobs`` as JSON values, for a streamed chunk."""
    if scored is None:
        return None
    return [None if e is None else {k: v.model_dump() for k, v in e.items()} for e in scored]


def _generated(lps: list[TokenLogprob]) -> list[tuple[int, TokenLogprob | None]]:
    return [(lp.token_id, lp) for lp in lps]


def _echoed(out: RequestOutput) -> list[tuple[int, TokenLogprob | None]]:
    """The prompt's tokens with their logprobs (the first has none), for echo + logprobs."""
    scored = out.prompt_logprobs
    if scored is None:  # the engine scores every prompt that asks: a missing list is a bug, named
        raise RuntimeError(f"request {out.request_id!r} asked for prompt logprobs and got none")
    return list(zip(out.prompt_token_ids, scored, strict=True))


def _vllm_prompt_logprobs(st: ServerState, out: RequestOutput, top_n: int | None) -> PromptLogprobs | None:
    """``prompt_logprobs`` as vLLM returns them: per prompt token ``{token id: {logprob, rank,
    decoded_token}}``, the prompt's own token first, then the top-n (one entry when it is among
    them); None for the first token. None when ``top_n`` is None (the field was not asked for)."""
    if top_n is None or out.prompt_logprobs is None:
        return None
    tok = st.tokenizer
    result: PromptLogprobs = []
    for lp in out.prompt_logprobs:
        if lp is None:
            result.append(None)
            continue
        entry = {
            str(lp.token_id): PromptLogprob(
                logprob=lp.logprob, rank=lp.rank, decoded_token=tok.token_string(lp.token_id)
            )
        }
        for rank, (t, v) in enumerate(lp.top[:top_n], start=1):
            entry.setdefault(str(t), PromptLogprob(logprob=v, rank=rank, decoded_token=tok.token_string(t)))
        result.append(entry)
    return result


def _openai_call(call: ToolCall) -> ToolCallModel:
    """A parsed call as OpenAI's ``tool_calls[]`` entry."""
    return ToolCallModel(id=call.id, function=FunctionCallModel(name=call.name, arguments=call.arguments))


def _chat_logprobs(st: ServerState, lps: list[TokenLogprob], top_n: int) -> ChatLogprobs:
    tok = st.tokenizer

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        # each token's own bytes: an emoji split over 2 tokens is [240, 159, 152] + [128], not U+FFFD twice
        return {"token": tok.token_string(token_id), "logprob": logprob, "bytes": list(tok.token_bytes(token_id))}

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **entry(lp.token_id, lp.logprob), top_logprobs=[TopLogprob(**entry(t, v)) for t, v in lp.top[:top_n]]
            )
            for lp in lps
        ]
    )


# -- completions --------------------------------------------------------------------------------------


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
async def create_completion(body: CompletionRequest, request: Request) -> Response | CompletionResponse:
    """OpenAI completions: one or more prompts, ``n`` completions each."""
    st = get_state(request)
    model = st.model_name(body.model)
    body.check_supported()
    prompts = body.prompts()
    st.check_fan_out(len(prompts), body.n)  # before any prompt is tokenized
    max_tokens = st.max_tokens(body.max_tokens)
    params = body.sampling_params(max_tokens, body.logprobs)
    if params.logit_bias:
        st.check_token_ids(list(params.logit_bias), "logit_bias")
    if params.structured is not None:  # built once, by sampling_params
        await st.check_structured(params.structured, body.structured_param)
    prompt_ids: list[list[int]] = []
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        if isinstance(p, list):
            st.check_token_ids(p, param)
            ids = p
        else:
            ids = await st.encode(p, param)
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        st.check_context(len(ids), max_tokens, param, "max_tokens")
        prompt_ids.append(ids)
    base = f"cmpl-{uuid.uuid4().hex}"
    streams: Streams = {
        i: engine_outputs(st, f"{base}-{i}", p, params, st.lora_for(model)) for i, p in enumerate(prompt_ids)
    }
    created = int(time.time())
    echo: dict[int, str] = {}
    if body.echo:
        echo = {i: p if isinstance(p, str) else await st.decode(p) for i, p in enumerate(prompts)}
    if body.stream:
        firsts = await start_streams(streams)
        gen = _completion_stream(st, body, params, base, model, created, echo, firsts, streams)
        return StreamingResponse(gen, media_type="text/event-stream")
    try:
        finals = await collect(request, streams)
    except ClientDisconnected:
        return Response(status_code=499)
    choices = []
    for i, out in sorted(finals.items()):
        prompt_logprobs = _vllm_prompt_logprobs(st, out, body.prompt_logprobs)
        for c in out.outputs:
            prefix = echo.get(i, "")
            logprobs = None
            if c.logprobs is not None:
                tokens = _generated(c.logprobs)
                if body.echo_logprobs:
                    tokens = _echoed(out) + tokens
                logprobs = _completion_logprobs(st, tokens, 0 if body.echo_logprobs else len(prefix), body.logprobs)
            choices.append(
                CompletionChoice(
                    index=i * params.n + c.index,
                    text=prefix + c.text,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=prompt_logprobs,
                )
            )
    return CompletionResponse(id=base, created=created, model=model, choices=choices, usage=_usage(finals))


async def _completion_stream(
    st: ServerState,
    body: CompletionRequest,
    params: SamplingParams,
    base: str,
    model: str,
    created: int,
    echo: dict[int, str],
    firsts: dict[int, RequestOutput],
    streams: Streams,
) -> AsyncIterator[str]:
    cursors: dict[int, ChoiceCursor] = {}
    prompt_tokens = {i: len(o.prompt_token_ids) for i, o in firsts.items()}
    try:
        async for i, out in merge(firsts, streams):
            for c in out.outputs:
                index = i * params.n + c.index
                cursor = cursors.get(index)
                first = cursor is None
                if cursor is None:
                    cursor = cursors[index] = ChoiceCursor(params.stop)
                prefix = echo.get(i, "") if first else ""
                # a choice's first chunk carries the echoed prompt and its logprobs, even before any text
                opening = first and (bool(prefix) or body.echo_logprobs or body.prompt_logprobs is not None)
                delta = cursor.advance(c)
                if delta is None and not opening:
                    continue
                new_text = delta.text if delta else ""
                text = prefix + new_text
                logprobs = None
                if body.logprobs is not None:
                    if first and body.echo_logprobs:
                        tokens, offset = _echoed(out), 0
                    else:  # offsets count from the start of the whole text (the echoed prompt's, if any)
                        tokens, offset = [], len(echo.get(i, "")) + cursor.chars - len(new_text)
                    if delta is not None:
                        tokens += _generated(delta.logprobs)
                    if tokens or delta is not None:
                        logprobs = _completion_logprobs(st, tokens, offset, body.logprobs).model_dump()
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": delta.finish_reason if delta else None,
                    "stop_reason": c.stop_reason if c.finished else None,
                }
                if first and body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _dump(_vllm_prompt_logprobs(st, out, body.prompt_logprobs))
                yield sse(
                    {"id": base, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
                )
        if body.include_usage:
            usage = _usage_from_counts(sum(prompt_tokens.values()), sum(c.tokens for c in cursors.values()))
            yield sse(
                {
                    "id": base,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
            )
    except Exception as exc:  # noqa: BLE001 - the response has started: report in-band
        err = as_api_error(exc)
        yield sse(error_body(err.status, err.message, err.param, err.type))
    finally:
        await close_all(streams.values())
    yield _DONE


# -- chat -----------------------------------------------------------------------------------------------


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletionResponse:
    """OpenAI chat completions on the model's chat template."""
    st = get_state(request)
    model = st.model_name(body.model)
    body.check_supported()
    st.check_fan_out(1, body.n)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = st.max_tokens(body.max_new_tokens)
    params = body.sampling_params(max_tokens, logprobs)
    if params.logit_bias:
        st.check_token_ids(list(params.logit_bias), "logit_bias")
    if params.structured is not None:  # built once, by sampling_params
        await st.check_structured(params.structured, body.structured_param)
    tools = body.tool_list
    if (calls_only := body.call_constraint()) is not None:  # a required or named call: the reply is calls
        await st.check_structured(calls_only, "tools")
        params = dataclasses.replace(params, structured=calls_only)
    messages, template_vars = chat_messages(body.template_messages(), tools, st.tokenizer.chat_template)
    prompt = await st.chat_prompt(messages, "messages", body.add_generation_prompt, template_vars)
    st.check_context(len(prompt), max_tokens, "messages", body.max_tokens_param)
    base = f"chatcmpl-{uuid.uuid4().hex}"
    streams: Streams = {0: engine_outputs(st, base, prompt, params, st.lora_for(model))}
    created = int(time.time())
    top_n = body.top_logprobs or 0
    if body.stream:
        firsts = await start_streams(streams)
        return StreamingResponse(
            _chat_stream(st, body, params, base, model, created, firsts, streams), media_type="text/event-stream"
        )
    try:
        finals = await collect(request, streams)
    except ClientDisconnected:
        return Response(status_code=499)
    out = finals[0]
    choices = []
    for c in out.outputs:
        message, finish_reason = ChatResponseMessage(content=c.text), c.finish_reason
        if tools:
            content, calls = parse_tool_calls(c.text, tools)
            if calls:
                message = ChatResponseMessage(content=content, tool_calls=[_openai_call(call) for call in calls])
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=_chat_logprobs(st, c.logprobs, top_n) if c.logprobs is not None else None,
                finish_reason=finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    return ChatCompletionResponse(
        id=base,
        created=created,
        model=model,
        choices=choices,
        usage=_usage(finals),
        prompt_logprobs=_vllm_prompt_logprobs(st, out, body.prompt_logprobs),
    )


async def _chat_stream(
    st: ServerState,
    body: ChatCompletionRequest,
    params: SamplingParams,
    base: str,
    model: str,
    created: int,
    firsts: dict[int, RequestOutput],
    streams: Streams,
) -> AsyncIterator[str]:
    head = {"id": base, "object": "chat.completion.chunk", "created": created, "model": model}
    cursors: dict[int, ChoiceCursor] = {}
    tools = body.tool_list
    calls: dict[int, ToolCallStream] = {}  # per choice, with tools: text and whole calls split
    top_n = body.top_logprobs or 0
    prompt_tokens = len(firsts[0].prompt_token_ids)
    try:
        async for _, out in merge(firsts, streams):
            for c in out.outputs:
                cursor = cursors.get(c.index)
                if cursor is None:  # a choice's first chunk carries the role
                    extra = {}
                    if (
                        not cursors and body.prompt_logprobs is not None
                    ):  # and the stream's first, the prompt's logprobs
                        extra["prompt_logprobs"] = _dump(_vllm_prompt_logprobs(st, out, body.prompt_logprobs))
                    cursor = cursors[c.index] = ChoiceCursor(params.stop)
                    role = {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield sse({**head, "choices": [role], **extra})
                delta = cursor.advance(c)
                if delta is None:
                    continue
                logprobs = _chat_logprobs(st, delta.logprobs, top_n).model_dump() if body.logprobs else None
                text, finish_reason = delta.text, delta.finish_reason
                payload: dict[str, Any] = {}
                if tools:
                    split = calls.setdefault(c.index, ToolCallStream(tools))
                    first = split.num_calls
                    text, made = split.feed(text, final=c.finished)
                    if made:  # each call whole: its id and name, then its arguments in one piece
                        payload["tool_calls"] = [
                            {"index": first + k, **_openai_call(call).model_dump()} for k, call in enumerate(made)
                        ]
                    if finish_reason == "stop" and split.num_calls:
                        finish_reason = "tool_calls"
                if text:
                    payload["content"] = text
                if "tool_calls" in payload and finish_reason is not None:
                    # the calls first, the finish in a chunk of its own, as OpenAI sends them (the
                    # openai client's stream helper closes a call only on a later chunk)
                    calls_chunk = {"index": c.index, "delta": payload, "logprobs": logprobs, "finish_reason": None}
                    yield sse({**head, "choices": [calls_chunk]})
                    payload, logprobs = {}, None
                choice = {
                    "index": c.index,
                    "delta": payload,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason if c.finished else None,
                }
                yield sse({**head, "choices": [choice]})
        if body.include_usage:
            usage = _usage_from_counts(prompt_tokens, sum(c.tokens for c in cursors.values()))
            yield sse({**head, "choices": [], "usage": usage})
    except Exception as exc:  # noqa: BLE001 - the response has started: report in-band
        err = as_api_error(exc)
        yield sse(error_body(err.status, err.message, err.param, err.type))
    finally:
        await close_all(streams.values())
    yield _DONE
