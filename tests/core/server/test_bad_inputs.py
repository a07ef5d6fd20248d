"""Bad input gets a 4xx in the OpenAI error shape, naming the field; the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_helpers import ServerProcess

CHAT = [{"role": "user", "content": "Hi"}]
LONG = "word " * 3000  # over the 1024-token context

# (id, path, JSON body or raw bytes, expected status, expected param or None)
CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("prompt-wrong-type", "/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("max-tokens-string", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("max-tokens-negative", "/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("temperature-negative", "/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("top-p-over-1", "/v1/chat/completions", {"messages": CHAT, "top_p": 1.5}, 400, "top_p"),
    ("empty-messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("unknown-role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("missing-messages", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("unknown-field", "/v1/completions", {"prompt": "x", "temprature": 0.5}, 400, "temprature"),
    ("huge-n", "/v1/completions", {"prompt": "x", "n": 100000}, 400, "n"),
    ("seed-overflow", "/v1/completions", {"prompt": "x", "seed": 2**80}, 400, "seed"),
    ("empty-stop", "/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("logprobs-too-many", "/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("top-logprobs-without-logprobs", "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, None),
    ("token-out-of-vocab", "/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("prompt-over-context", "/v1/completions", {"prompt": LONG}, 400, None),
    ("chat-over-context", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, None),
    ("empty-prompt", "/v1/completions", {"prompt": ""}, 400, None),
    ("logit-bias", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ("tools", "/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("unknown-model", "/v1/completions", {"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ("anthropic-no-max-tokens", "/v1/messages", {"model": "m", "messages": CHAT}, 400, "max_tokens"),
    ("anthropic-bad-role", "/v1/messages", {"model": "", "max_tokens": 2, "messages": [{"role": "system",
                                                                                          "content": "x"}]}, 400, None),
    ("detokenize-bad-id", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("tokenize-both", "/tokenize", {"prompt": "x", "messages": CHAT}, 400, None),
    ("malformed-json", "/v1/completions", b'{"prompt": "x", ', 400, None),
    ("non-utf8-body", "/v1/completions", b'{"prompt": "\xff\xfe\xfd"}', 400, None),
    ("json-not-object", "/v1/chat/completions", b"[1, 2, 3]", 400, None),
    ("no-such-route", "/v1/nothing", {}, 404, None),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(server: ServerProcess, path: str, body: Any, status: int, param: str | None) -> None:
    with server.client() as http:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert err["code"] == status and isinstance(err["type"], str)
        if param is not None:
            assert err["param"] is not None and err["param"].startswith(param), err
        if path == "/v1/messages":
            assert r.json()["type"] == "error"  # the Anthropic SDK's shape, too
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def test_streaming_refusal_is_an_http_error(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": LONG, "stream": True}, timeout=60)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
