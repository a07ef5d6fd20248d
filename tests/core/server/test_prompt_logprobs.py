"""Prompt logprobs over HTTP: ``echo`` + ``logprobs`` on completions (OpenAI's legacy shape) and vLLM's
``prompt_logprobs`` field on completions and chat, read with the official ``openai`` client."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from server_helpers import ServerProcess

from plinth import SamplingParams

PROMPT = "The three primary colors are red, yellow and"
CHAT = [{"role": "user", "content": "Name a fruit that is yellow."}]
#: the server and the offline engine run the same model on the same backend, one request at a
#: time, so the same chunks: equal up to float32 summation order in a differently sized batch
TOL = 1e-3


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref(offline_llm: Any) -> Any:
    """The offline engine's greedy completion of PROMPT with its prompt's logprobs (top 3)."""
    return offline_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3, logprobs=3))[0]


def test_echo_with_logprobs_puts_the_prompt_tokens_first(client: openai.OpenAI, ref: Any) -> None:
    prompt_ids = ref.prompt_token_ids
    completion = ref.outputs[0]
    for stream in (False, True):
        resp = client.completions.create(
            model="", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=2, stream=stream
        )
        choices = [c.choices[0] for c in resp] if stream else resp.choices  # type: ignore[union-attr]
        text = "".join(c.text for c in choices)
        lp: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for c in choices:
            if c.logprobs is not None:
                for key in lp:
                    lp[key] += getattr(c.logprobs, key) or []
        assert text == PROMPT + completion.text, stream
        n = len(prompt_ids)
        assert len(lp["tokens"]) == n + len(completion.token_ids), stream
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for p in range(1, n):
            want = ref.prompt_logprobs[p]
            assert lp["token_logprobs"][p] == pytest.approx(want.logprob, abs=TOL), (stream, p)
            assert len(lp["top_logprobs"][p]) == 2
            assert sorted(lp["top_logprobs"][p].values(), reverse=True) == pytest.approx(
                [v for _, v in want.top[:2]], abs=TOL
            )
        for j, want in enumerate(completion.logprobs):
            assert lp["token_logprobs"][n + j] == pytest.approx(want.logprob, abs=TOL)
        # offsets run over the whole text: the prompt's characters, then the completion's
        offsets = lp["text_offset"]
        assert offsets[0] == 0 and offsets == sorted(offsets)
        assert offsets[n] == len(PROMPT), stream
        assert "".join(lp["tokens"][:n]).replace("Ġ", " ") == PROMPT


def _check_vllm_shape(scored: list[Any], ref: Any, top: int) -> None:
    """vLLM's ``prompt_logprobs``: None, then per token {id: {logprob, rank, decoded_token}}."""
    assert scored[0] is None and len(scored) == len(ref.prompt_token_ids)
    for p in range(1, len(scored)):
        want = ref.prompt_logprobs[p]
        entry = scored[p]
        own = entry[str(ref.prompt_token_ids[p])]
        assert own["logprob"] == pytest.approx(want.logprob, abs=TOL)
        assert own["rank"] == want.rank and isinstance(own["decoded_token"], str)
        ranked = sorted((v["rank"], v["logprob"]) for k, v in entry.items() if k != str(ref.prompt_token_ids[p]))
        assert len(entry) in (top, top + 1)
        assert [r for r, _ in ranked] == [r for r in range(1, top + 1) if r != want.rank]


def test_prompt_logprobs_field_on_completions(server: ServerProcess, ref: Any) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "prompt_logprobs": 3}
    with server.client() as http:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["logprobs"] is None  # the field does not turn on the legacy logprobs
        _check_vllm_shape(choice["prompt_logprobs"], ref, 3)
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            events = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
        firsts = [e["choices"][0] for e in events if "prompt_logprobs" in e["choices"][0]]
        assert len(firsts) == 1
        _check_vllm_shape(firsts[0]["prompt_logprobs"], ref, 3)
        assert "".join(e["choices"][0]["text"] for e in events) == ref.outputs[0].text


def test_prompt_logprobs_field_on_chat(client: openai.OpenAI, offline_llm: Any) -> None:
    [ref] = offline_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1))
    resp = client.chat.completions.create(
        model="",
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        extra_body={"prompt_logprobs": 1},  # type: ignore[arg-type]
    )
    assert resp.choices[0].message.content == ref.outputs[0].text
    _check_vllm_shape(resp.model_extra["prompt_logprobs"], ref, 1)  # type: ignore[index]
    chunks = list(
        client.chat.completions.create(
            model="",
            messages=CHAT,
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"prompt_logprobs": 1},  # type: ignore[arg-type]
        )
    )
    scored = [c.model_extra["prompt_logprobs"] for c in chunks if (c.model_extra or {}).get("prompt_logprobs")]
    assert len(scored) == 1
    _check_vllm_shape(scored[0], ref, 1)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": "5"}),
        ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 100}),
    ],
)
def test_bad_prompt_logprobs_are_400s_naming_the_field(server: ServerProcess, path: str, body: Any) -> None:
    with server.client() as http:
        r = http.post(path, json={**body, "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt_logprobs" and "prompt_logprobs" in err["message"]
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200
