"""Tool use on ``/v1/messages`` with the official ``anthropic`` client: a forced tool, ``any``, the
streamed ``input_json_delta`` events, and a conversation carrying ``tool_use``/``tool_result`` blocks."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from server_helpers import ServerProcess

pytestmark = pytest.mark.slow

WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
CLOCK = {
    "name": "get_time",
    "description": "The time in a time zone",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, CLOCK)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_forced_tool(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(
        model="", max_tokens=60, messages=ASK, tools=[WEATHER, CLOCK], extra_body={"temperature": 0},
        tool_choice={"type": "tool", "name": "get_weather"},
    )  # fmt: skip
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["get_weather"] and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, SCHEMAS["get_weather"])


def test_any_tool_streamed(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model="", max_tokens=60, messages=ASK, tools=[WEATHER, CLOCK], extra_body={"temperature": 0},
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:  # fmt: skip
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds  # the client's event for an input_json_delta
    assert final.stop_reason == "tool_use"
    (use,) = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(use.input, SCHEMAS[use.name])


def test_tool_results_continue_the_conversation(client: anthropic.Anthropic) -> None:
    first = client.messages.create(
        model="",
        max_tokens=60,
        messages=ASK,
        tools=[WEATHER],
        extra_body={"temperature": 0},
        tool_choice={"type": "any"},
    )
    use = next(b for b in first.content if b.type == "tool_use")
    history = [
        *ASK,
        {"role": "assistant", "content": first.content},  # the blocks as the client returned them
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": json.dumps({"celsius": 21})},
            {"type": "text", "text": "Summarise it in one sentence."},
        ]},
    ]  # fmt: skip
    reply = client.messages.create(
        model="", max_tokens=30, messages=history, tools=[WEATHER], extra_body={"temperature": 0}
    )
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use") and reply.content


def test_tool_choice_naming_no_tool_is_400(server: ServerProcess) -> None:
    with server.client() as http:
        resp = http.post(
            "/v1/messages",
            json={"model": "", "max_tokens": 4, "messages": ASK, "tools": [WEATHER],
                  "tool_choice": {"type": "tool", "name": "nope"}},
        )  # fmt: skip
    assert resp.status_code == 400 and "nope" in resp.text, resp.text
