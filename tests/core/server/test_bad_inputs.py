"""Bad input gets a 4xx in the OpenAI error shape, naming the field; the server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from server_helpers import ServerProcess

CHAT = [{"role": "user", "content": "Hi"}]
LONG = "word " * 3000  # over the 1024-token context

NEAR = "word " * 990  # 991 prompt tokens (1021 as a chat): room for ~30 more in the 1024-token context
U = "\ud800"  # a lone surrogate: JSON allows the escape, Unicode has no such character
ANTHROPIC = {"model": "", "max_tokens": 2}

# (id, path, JSON body or raw bytes, expected status, the exact param: None when no one field is at fault)
CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("prompt-wrong-type", "/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("max-tokens-string", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("max-tokens-numeric-string", "/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("max-tokens-negative", "/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("max-tokens-past-context", "/v1/completions", {"prompt": NEAR, "max_tokens": 60}, 400, "max_tokens"),
    ("max-completion-tokens-past-context", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": NEAR}], "max_completion_tokens": 60}, 400, "max_completion_tokens"),
    ("anthropic-max-tokens-past-context", "/v1/messages",
     {**ANTHROPIC, "max_tokens": 60, "messages": [{"role": "user", "content": NEAR}]}, 400, "max_tokens"),
    ("stream-yes", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("logprobs-true-on-completions", "/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("prompt-bool-ids", "/v1/completions", {"prompt": [[False]]}, 400, "prompt.0.0"),
    ("temperature-string", "/v1/completions", {"prompt": "x", "temperature": "0.5"}, 400, "temperature"),
    ("temperature-negative", "/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("top-p-over-1", "/v1/chat/completions", {"messages": CHAT, "top_p": 1.5}, 400, "top_p"),
    ("empty-messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("unknown-role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    ("content-wrong-type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages.0.content"),
    ("tool-without-call-id", "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages.0.tool_call_id"),
    ("tool-calls-on-user", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "messages.0.tool_calls"),
    ("missing-messages", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("unknown-field", "/v1/completions", {"prompt": "x", "temprature": 0.5}, 400, "temprature"),
    ("huge-n", "/v1/completions", {"prompt": "x", "n": 100000}, 400, "n"),
    ("seed-overflow", "/v1/completions", {"prompt": "x", "seed": 2**80}, 400, "seed"),
    ("empty-stop", "/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("too-many-stops", "/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
    ("over-long-stop", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": "a" * 1025},
     400, "stop"),
    ("anthropic-too-many-stops", "/v1/messages",
     {**ANTHROPIC, "messages": CHAT, "stop_sequences": ["a"] * 17},
     400,
     "stop_sequences"),
    ("logprobs-too-many", "/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("token-out-of-vocab", "/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("prompt-over-context", "/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("batch-prompt-over-context", "/v1/completions", {"prompt": ["Hi", LONG]}, 400, "prompt.1"),
    ("chat-over-context", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("empty-prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("logit-bias-key", "/v1/completions", {"prompt": "x", "logit_bias": {"five": 1.0}}, 400, "logit_bias"),
    ("logit-bias-negative-key", "/v1/completions", {"prompt": "x", "logit_bias": {"-5": 1.0}}, 400, "logit_bias"),
    ("logit-bias-out-of-vocab", "/v1/completions", {"prompt": "x", "logit_bias": {"999999999": 1}}, 400, "logit_bias"),
    ("logit-bias-range", "/v1/chat/completions", {"messages": CHAT, "logit_bias": {"5": 150}}, 400, "logit_bias"),
    ("logit-bias-type", "/v1/completions", {"prompt": "x", "logit_bias": {"5": "high"}}, 400, "logit_bias.5"),
    ("tools", "/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ("unknown-model", "/v1/completions", {"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ("fan-out", "/v1/completions", {"prompt": ["a"] * 256, "n": 64}, 400, "n"),
    ("surrogate-prompt", "/v1/completions", {"prompt": U}, 400, "prompt"),
    ("surrogate-batch-prompt", "/v1/completions", {"prompt": ["ok", "a" + U]}, 400, "prompt.1"),
    ("surrogate-stop", "/v1/completions", {"prompt": "x", "stop": [U]}, 400, "stop.0"),
    ("surrogate-model", "/v1/completions", {"prompt": "x", "model": U}, 400, "model"),
    ("surrogate-message", "/v1/chat/completions", {"messages": [{"role": "user", "content": U}]}, 400,
     "messages.0.content"),
    ("surrogate-text-part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": U}]}]}, 400, "messages.0.content.0.text"),
    ("surrogate-tokenize", "/tokenize", {"prompt": "Hi " + U}, 400, "prompt"),
    ("surrogate-tokenize-messages", "/tokenize", {"messages": [{"role": "user", "content": U}]}, 400,
     "messages.0.content"),
    ("surrogate-anthropic", "/v1/messages", {**ANTHROPIC, "messages": [{"role": "user", "content": U}]}, 400,
     "messages.0.content"),
    ("surrogate-anthropic-system", "/v1/messages", {**ANTHROPIC, "system": U, "messages": CHAT}, 400, "system"),
    ("anthropic-no-max-tokens", "/v1/messages", {"model": "m", "messages": CHAT}, 400, "max_tokens"),
    ("anthropic-bad-role", "/v1/messages", {**ANTHROPIC, "messages": [{"role": "system", "content": "x"}]}, 400,
     "messages.0.role"),
    ("anthropic-prefill-trailing-space", "/v1/messages",
     {**ANTHROPIC, "messages": [*CHAT, {"role": "assistant", "content": "Sure, "}]}, 400, "messages"),
    ("detokenize-bad-id", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("tokenize-both", "/tokenize", {"prompt": "x", "messages": CHAT}, 400, None),
    ("malformed-json", "/v1/completions", b'{"prompt": "x", ', 400, None),
    ("non-utf8-body", "/v1/completions", b'{"prompt": "\xff\xfe\xfd"}', 400, None),
    ("too-deep-json", "/v1/completions", b"[" * 100_000, 400, None),
    ("json-not-object", "/v1/chat/completions", b"[1, 2, 3]", 400, None),
    ("no-such-route", "/v1/nothing", {}, 404, None),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(server: ServerProcess, path: str, body: Any, status: int, param: str | None) -> None:
    with server.client() as http:
        # json.dumps writes a lone surrogate as its \\ud800 escape (httpx's json= would fail to encode it)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = http.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert err["code"] == status and isinstance(err["type"], str)
        assert err["param"] == param, err
        if param is not None:
            assert param.split(".")[0] in err["message"], err  # the message names the field too
        if path == "/v1/messages":
            assert r.json()["type"] == "error"  # the Anthropic SDK's shape, too
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_too_deep_json_says_so(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/completions", content=b"[" * 100_000, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text


def test_streaming_refusal_is_an_http_error(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": LONG, "stream": True}, timeout=60)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
