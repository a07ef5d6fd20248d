"""Structured output through the real server: ``response_format`` and ``structured_outputs``, with the
official ``openai`` client (``parse`` with a pydantic model, streaming) and plain HTTP for the 400s."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
from server_helpers import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    population: int
    climate: Literal["cold", "mild", "hot"]


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model="",
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=64,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, City)  # the client validated it against the model
    assert message.parsed.climate in ("cold", "mild", "hot")


def test_json_object_and_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Give a JSON object with a name and an age."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=64,
        stream=True,
    )
    text = ""
    reasons = []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "stop", text
    assert isinstance(json.loads(text), dict)


def test_json_schema_on_completions_and_sampled(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0}},
        "required": ["colour", "n"],
        "additionalProperties": False,
    }
    out = client.completions.create(
        model="",
        prompt="A colour and a count as JSON:",
        max_tokens=40,
        n=4,
        seed=7,
        temperature=1.0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}},
    )
    for choice in out.choices:  # random samples, every one valid
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.text), schema)


def test_regex_and_choice(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="",
        prompt="The date of the moon landing:",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"(19|20)\d\d-\d\d-\d\d"}},
    )
    assert re.fullmatch(r"(19|20)\d\d-\d\d-\d\d", out.choices[0].text), out.choices[0].text
    assert out.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        max_tokens=5,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no", 'it "depends"']}},
    )
    assert chat.choices[0].message.content in ("yes", "no", 'it "depends"')


UNIQUE = {"type": "array", "uniqueItems": True}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "u", "schema": UNIQUE}}},
            "response_format",
            "uniqueItems",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {"type": "string"}}}}},
            "response_format",
            "not",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs", "missing_rule"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "type"),
    ],
)
def test_unenforceable_constraints_are_400_naming_the_keyword(
    server: ServerProcess, body: dict[str, object], param: str, words: str
) -> None:
    with server.client() as http:
        resp = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **body},
        )
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"].startswith(param), error
        assert words in error["message"], error
        # the server keeps serving
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200
