"""Tool calling through the real server with the official ``openai`` client: named and required calls
(constrained: arguments valid against the tool's schema), ``parse`` with a pydantic tool, streamed
tool-call deltas, a conversation carrying earlier calls and results, and the 400s."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pydantic
import pytest
from server_helpers import ServerProcess

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _check(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_call(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    _check(choice.message.tool_calls[0])
    assert choice.message.content is None


def test_required_call_one_at_a_time(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "What time is it in Berlin?"}], tools=[WEATHER, TIME],
        tool_choice="required", parallel_tool_calls=False, temperature=0.8, seed=3, n=3, max_tokens=60,
    )  # fmt: skip
    for choice in out.choices:  # sampled, each one a single valid call
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        _check(choice.message.tool_calls[0])


class Lookup(pydantic.BaseModel):
    """Look up a word in the dictionary."""

    word: str = pydantic.Field(max_length=20)
    language: str = pydantic.Field(max_length=10)


def test_parse_with_a_pydantic_tool(client: openai.OpenAI) -> None:
    out = client.chat.completions.parse(
        model="", messages=[{"role": "user", "content": "What does 'plinth' mean?"}], temperature=0, max_tokens=60,
        tools=[openai.pydantic_function_tool(Lookup)], tool_choice="required", parallel_tool_calls=False,
    )  # fmt: skip
    call = out.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Lookup)  # the client parsed and validated them


def test_streamed_tool_call_deltas(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model="", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=60, tool_choice="required",
        parallel_tool_calls=False,
    ) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds, (kinds, final)
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    for call in choice.message.tool_calls:
        _check(call)


def test_a_conversation_with_calls_and_results(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model="", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60,
        parallel_tool_calls=False,
    )  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    reply = client.chat.completions.create(model="", messages=history, tools=[WEATHER], temperature=0, max_tokens=30)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    message = reply.choices[0].message
    assert message.content or message.tool_calls


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "same name"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "uniqueItems",
        ),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "pattern"),
    ],
)
def test_bad_tool_requests_are_400(server: ServerProcess, extra: dict[str, Any], param: str, words: str) -> None:
    body = {"messages": ASK, "max_tokens": 4, "tools": [WEATHER], **extra}
    with server.client() as http:
        resp = http.post("/v1/chat/completions", json={k: v for k, v in body.items() if v is not None})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"] or "").startswith(param) and words in error["message"], error
