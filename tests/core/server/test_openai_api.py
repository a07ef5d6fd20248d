"""The official ``openai`` client (and raw HTTP) against a real server: equal to the offline API."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest
from server_helpers import ServerProcess

from plinth import SamplingParams

PROMPT = "The three primary colors are"
CHAT = [{"role": "user", "content": "Name a fruit that is yellow."}]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def ref_completion(offline_llm: Any) -> Any:
    """The offline greedy completion of PROMPT (12 tokens)."""
    return offline_llm.generate([PROMPT], _greedy(12))[0]


def test_completion_equals_offline(client: openai.OpenAI, ref_completion: Any) -> None:
    ref = ref_completion
    expected = ref.outputs[0]
    resp = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=12, temperature=0)
    assert resp.choices[0].text == expected.text
    assert resp.usage is not None and resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.choices[0].finish_reason == expected.finish_reason

    chunks = list(
        client.completions.create(
            prompt=PROMPT, model="", max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason


def test_chat_equals_offline(client: openai.OpenAI, offline_llm: Any) -> None:
    [ref] = offline_llm.chat(CHAT, _greedy(12))
    expected = ref.outputs[0]
    resp = client.chat.completions.create(model="", messages=CHAT, max_completion_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert resp.choices[0].message.content == expected.text
    assert resp.usage is not None and resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)

    stream = client.chat.completions.create(
        model="",
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},  # type: ignore[arg-type]
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_batch_n_seed_extras_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model="",
        prompt=["Once upon a time", "In a galaxy far away"],
        n=2,
        max_tokens=6,
        temperature=0.8,
        seed=7,
        logprobs=2,
        extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2},
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    for c in resp.choices:
        assert c.logprobs is not None and len(c.logprobs.tokens or []) == 6
        assert all(len(t) <= 2 for t in c.logprobs.top_logprobs or [])
    again = client.completions.create(
        model="", prompt="Once upon a time", n=2, max_tokens=6, temperature=0.8, seed=7,
        extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2},
    )  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in resp.choices if c.index < 2]
    assert resp.usage is not None and resp.usage.completion_tokens == 24


def test_logit_bias_bans_and_forces_tokens_as_offline(
    client: openai.OpenAI, offline_llm: Any, ref_completion: Any
) -> None:
    """OpenAI's ``logit_bias`` (string token ids): -100 bans the greedy first token, +100 forces a
    token at every step; the server's choices equal the offline API's with the same bias."""
    first = ref_completion.outputs[0].token_ids[0]
    banned = client.completions.create(
        model="", prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(first): -100}, logprobs=0
    )
    offline = offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, logit_bias={first: -100}))
    assert banned.choices[0].text == offline[0].outputs[0].text
    assert offline[0].outputs[0].token_ids[0] != first
    forced_id = 1234
    forced = client.chat.completions.create(
        model="", messages=CHAT, max_tokens=3, temperature=0, logit_bias={str(forced_id): 100}
    )
    expected = offline_llm.tokenizer.decode([forced_id] * 3)
    assert forced.choices[0].message.content == expected


def test_chat_logprobs_stop_echo(client: openai.OpenAI, ref_completion: Any) -> None:
    resp = client.chat.completions.create(
        model="",
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,  # type: ignore[arg-type]
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == resp.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)

    text = ref_completion.outputs[0].text
    stop = text.strip().split()[2]  # a word in the middle of the greedy text
    for stream in (False, True):
        out = client.completions.create(model="", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                                        echo=True, stream=stream)  # fmt: skip
        got = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text  # type: ignore[union-attr]
        assert got == PROMPT + text[: text.index(stop)]


def test_token_id_prompt(client: openai.OpenAI, offline_llm: Any) -> None:
    ids = offline_llm.tokenizer.encode(PROMPT)
    [ref] = offline_llm.generate([ids], _greedy(8))
    resp = client.completions.create(model="", prompt=ids, max_tokens=8, temperature=0)
    assert resp.choices[0].text == ref.outputs[0].text


def test_anthropic_messages(server: ServerProcess, offline_llm: Any) -> None:
    system = "You are terse."
    [ref] = offline_llm.chat([{"role": "system", "content": system}, *CHAT], _greedy(12))
    body = {"model": "", "max_tokens": 12, "temperature": 0, "system": system,
            "messages": [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]}  # fmt: skip
    with server.client() as http:
        r = http.post("/v1/messages", json={**body, "model": http.get("/v1/models").json()["data"][0]["id"]})
        assert r.status_code == 200, r.text
        msg = r.json()
        assert msg["type"] == "message" and msg["content"][0]["text"] == ref.outputs[0].text
        assert msg["usage"]["output_tokens"] == len(ref.outputs[0].token_ids)
        assert msg["stop_reason"] in {"end_turn", "max_tokens"}
        events, text = [], ""
        with http.stream("POST", "/v1/messages", json={**body, "model": msg["model"], "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("event: "):
                    events.append(line[7:])
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if data["type"] == "content_block_delta":
                        text += data["delta"]["text"]
    assert text == ref.outputs[0].text
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) <= {"content_block_delta"}


def test_small_routes(server: ServerProcess) -> None:
    with server.client() as http:
        models = http.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["max_model_len"] == 1024
        assert http.get("/health").status_code == 200
        assert http.get("/version").json()["version"]
        tok = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert tok["count"] == len(tok["tokens"]) > 0
        assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"].endswith(PROMPT)
        chat_tok = http.post("/tokenize", json={"messages": CHAT}).json()
        assert chat_tok["count"] > tok["count"]
        metrics = http.get("/metrics").text
    for name in [
        "plinth:num_requests_running",
        "plinth:num_requests_waiting",
        "plinth:kv_cache_usage_perc",
        "plinth:kv_cache_waste_perc",
        "plinth:prompt_tokens_total",
        "plinth:generation_tokens_total",
        "plinth:time_to_first_token_seconds_bucket",
        "plinth:inter_token_latency_seconds_bucket",
        "plinth:e2e_request_latency_seconds_bucket",
        "plinth:num_preemptions_total",
        "plinth:prefix_cache_hits_total",
        "plinth:prefix_cache_queries_total",
        "plinth:request_success_total",
    ]:
        assert name in metrics, name


def test_openapi_document(server: ServerProcess) -> None:
    doc = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/messages", "/tokenize"} <= set(doc["paths"])


def _spelled(token: str) -> bytes:
    """The bytes an OpenAI logprobs token string stands for (``\\xNN`` escapes and UTF-8 text)."""
    return b"".join(
        bytes([int(m[1], 16)]) if m[1] else m[2].encode() for m in re.finditer(r"\\x([0-9a-f]{2})|(.)", token, re.S)
    )


EMOJI = "Emoji: 🍎🍌🍇🍉🍎🍌🍇🍉🍎"  # the default model continues it with emoji, each split over 3 tokens


def test_logprobs_of_multibyte_text_carry_each_tokens_real_bytes(server: ServerProcess) -> None:
    with server.client() as http:
        body = {"prompt": EMOJI, "max_tokens": 6, "temperature": 0, "logprobs": 2}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"] and not choice["text"].isascii()
        assert "\ufffd" not in "".join(lp["tokens"]) and any("\\x" in t for t in lp["tokens"]), lp["tokens"]
        # the escaped bytes of the tokens spell the text
        raw = b"".join(_spelled(t) for t in lp["tokens"])
        assert raw.decode("utf-8") == choice["text"]
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])

        chat = {"messages": [{"role": "user", "content": EMOJI}], "max_tokens": 12, "temperature": 0}
        r = http.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 3})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        content = choice["logprobs"]["content"]
        joined = b"".join(bytes(e["bytes"]) for e in content)
        # before: every partial token was U+FFFD, bytes [239, 191, 189]
        assert joined.decode("utf-8", "replace") == choice["message"]["content"]
        assert any(bytes(e["bytes"]).decode("utf-8", "replace") != bytes(e["bytes"]).decode("utf-8", "ignore")
                   for e in content), content  # fmt: skip
        for e in content:
            assert e["token"] == bytes(e["bytes"]).decode("utf-8", "backslashreplace")
            for alt in e["top_logprobs"]:
                assert alt["token"] == bytes(alt["bytes"]).decode("utf-8", "backslashreplace")

        # streaming gives the same entries
        chunks = []
        with http.stream("POST", "/v1/chat/completions", json={**chat, "logprobs": True, "stream": True}) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
        assert [bytes(e["bytes"]) for e in streamed] == [bytes(e["bytes"]) for e in content]
