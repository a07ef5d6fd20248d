"""What real clients send and expect, against the main server: harmless fields accepted, OpenAI's tool
history shape, ``GET /v1/models/{id}``, Anthropic ``count_tokens`` and prefill, an honest
``/openapi.json``, vLLM-named metrics, and stop strings that hold back only what they must."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from server_helpers import ServerProcess

from plinth.runtime.outputs import CompletionOutput
from plinth.server.launch import _default_name
from plinth.server.streams import ChoiceCursor, partial_stop

CHAT = [{"role": "user", "content": "Name a fruit."}]


def test_fields_real_clients_send_are_accepted(server: ServerProcess) -> None:
    history = [
        {"role": "system", "content": "You are terse.", "name": "ops"},
        {"role": "user", "content": "What is the weather?", "name": "alice"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {
        "messages": history,
        "max_completion_tokens": 4,
        "store": False,
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "reasoning_effort": "low",
        "metadata": {"k": "v"},
        "user": "u-1",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with server.client() as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["usage"]["completion_tokens"] >= 1
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "store": True, "service_tier": "auto"})
        assert r.status_code == 200, r.text


def test_models_by_id_and_no_path_leak(server: ServerProcess) -> None:
    with server.client() as http:
        models = http.get("/v1/models").json()["data"]
        name = models[0]["id"]
        assert all("/" not in m["root"] and m["root"] == m["id"] for m in models), models
        one = http.get(f"/v1/models/{name}")
        assert one.status_code == 200 and one.json()["id"] == name
        missing = http.get("/v1/models/gpt-17")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_anthropic_count_tokens_and_prefill(server: ServerProcess) -> None:
    with server.client() as http:
        counted = http.post("/v1/messages/count_tokens", json={"model": "", "messages": CHAT, "system": "Be brief."})
        assert counted.status_code == 200, counted.text
        body = {"model": "", "messages": CHAT, "system": "Be brief.", "max_tokens": 3, "temperature": 0}
        reply = http.post("/v1/messages", json=body).json()
        assert reply["usage"]["input_tokens"] == counted.json()["input_tokens"]

        prefill = [*CHAT, {"role": "assistant", "content": "My favourite fruit is the"}]
        r = http.post("/v1/messages", json={**body, "messages": prefill})
        assert r.status_code == 200, r.text
        out = r.json()
        # the reply continues the prefill (and holds only the continuation)
        assert out["usage"]["input_tokens"] > reply["usage"]["input_tokens"] + 4
        assert not out["content"][0]["text"].startswith("My favourite")
        n = http.post("/v1/messages/count_tokens", json={"model": "", "messages": prefill, "system": "Be brief."})
        assert n.json()["input_tokens"] == out["usage"]["input_tokens"]


def test_openapi_describes_the_server(server: ServerProcess) -> None:
    with server.client() as http:
        schema = http.get("/openapi.json").json()
        assert http.get("/docs").status_code == 404  # off by default: the Swagger UI needs a CDN
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text
    paths = schema["paths"]
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/messages"):
        responses = paths[route]["post"]["responses"]
        assert "text/event-stream" in responses["200"]["content"]
        assert {"400", "401", "413", "503"} <= set(responses)
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    assert set(paths["/health"]["get"]["responses"]) == {"200", "503"}
    assert "/v1/models/{model_id}" in paths and "/v1/messages/count_tokens" in paths


def test_metrics_have_vllm_names(server: ServerProcess) -> None:
    with server.client() as http:
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    m = server.metrics()
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
        "time_to_first_token_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_decode_time_seconds_count",
        "request_queue_time_seconds_count",
        "request_prefill_time_seconds_count",
        "request_inference_time_seconds_count",
        "request_prompt_tokens_count",
        "request_generation_tokens_count",
    ):
        assert f"vllm:{name}" in m and f"plinth:{name}" in m, name
        assert m[f"vllm:{name}"] == m[f"plinth:{name}"] or "running" in name or "waiting" in name, name
    assert m["vllm:request_generation_tokens_count"] >= 1
    assert m["vllm:request_queue_time_seconds_count"] >= 1 and m["vllm:request_prefill_time_seconds_count"] >= 1
    assert m["http_requests_total"] >= 1


def test_stream_with_a_long_stop_string_still_streams(server: ServerProcess) -> None:
    stop = "this stop string is long and never occurs in the output at all"
    body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stop": [stop]}
    with server.client() as http:
        full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            deltas = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = [d["choices"][0]["text"] for d in deltas if d["choices"]]
    assert "".join(texts) == full
    # before: len(stop) - 1 = 62 characters were always held back, so the whole text came as one delta
    assert sum(bool(t) for t in texts) >= 8, texts


def _out(text: str, finished: bool = False) -> Any:
    return CompletionOutput(index=0, text=text, token_ids=[0] * len(text), finish_reason="stop" if finished else None)


def test_partial_stop_holds_back_only_a_possible_start() -> None:
    assert partial_stop("Hello Wor", ["World!"]) == 3
    assert partial_stop("Hello", ["World!"]) == 0
    assert partial_stop("ab", ["b", "abc"]) == 2
    cursor = ChoiceCursor(["</answer>"])
    first = cursor.advance(_out("The answer is 4 </ans"))
    assert first is not None and first.text == "The answer is 4 "
    second = cursor.advance(_out("The answer is 4 </ans", finished=True))
    assert second is not None and second.text == "</ans"


def test_default_served_name_is_never_a_path(tmp_path: Path) -> None:
    gguf = tmp_path / "models" / "tiny.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"")
    folder = tmp_path / "Llama-3.2-1B"
    folder.mkdir()
    assert _default_name(gguf) == "tiny.Q4_1"
    assert _default_name(folder) == "Llama-3.2-1B"  # not Path.stem's "Llama-3"
