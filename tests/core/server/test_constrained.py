"""One constrained server (tiny KV cache, bounded waiting, an API key): preemption, 401, 503, SIGTERM.

The tests share one process to save a model load; the SIGTERM test stops it, so it comes last.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_helpers import ServerProcess, running

from plinth import SamplingParams

KEY = "sk-test-secret"
# 7 usable KV blocks of 16 tokens: 4 requests of ~8 + 28 tokens start in 4 blocks and grow to 12
CONSTRAINED_ARGS = (
    "--num-kv-blocks", "8", "--max-model-len", "112", "--max-num-seqs", "4", "--max-waiting", "4",
    "--drain-timeout", "20",
)  # fmt: skip


@pytest.fixture(scope="module")
def constrained() -> Iterator[ServerProcess]:
    yield from running(*CONSTRAINED_ARGS, "--served-model-name", "default", "other", api_key=KEY)


@pytest.mark.slow
def test_preempted_requests_complete_with_greedy_outputs(constrained: ServerProcess, offline_llm: Any) -> None:
    prompts = [f"Fact {i}: the tallest mountain" for i in range(4)]
    expected = offline_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True))

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=constrained.url, headers=constrained.headers, timeout=600) as client:
            body = {"max_tokens": 28, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json={**body, "prompt": p}) for p in prompts))

    responses = asyncio.run(main())
    for resp, ref in zip(responses, expected, strict=True):
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["usage"]["completion_tokens"] == 28
        assert out["choices"][0]["text"] == ref.outputs[0].text
    m = constrained.metrics()
    assert m["plinth:num_preemptions_total"] > 0
    assert m["plinth:num_requests_running"] == 0 and m["plinth:kv_cache_usage_perc"] == 0.0


ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("POST", "/v1/messages", {"model": "", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}),
    ("POST", "/v1/messages/count_tokens", {"model": "", "messages": [{"role": "user", "content": "Hi"}]}),
    ("GET", "/v1/models/default", None),
    # the tokenizer routes do real work for whoever calls them, /metrics tells about the traffic
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/metrics", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_api_key_required(constrained: ServerProcess, method: str, path: str, body: dict | None) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, f"{constrained.url}{path}", json=body, headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.request(method, f"{constrained.url}{path}", json=body, headers=constrained.headers, timeout=60)
    assert r.status_code == 200, r.text
    if path == "/v1/messages":
        r = httpx.request(method, f"{constrained.url}{path}", json=body, headers={"x-api-key": KEY}, timeout=60)
        assert r.status_code == 200, r.text


def test_health_and_version_need_no_key(constrained: ServerProcess) -> None:
    assert httpx.get(f"{constrained.url}/health").status_code == 200
    assert httpx.get(f"{constrained.url}/version").status_code == 200


def test_overload_answers_503(constrained: ServerProcess) -> None:
    """4 seats, at most 4 waiting: of 12 slow requests sent at once, some must be refused."""
    body = {"prompt": "Count to one hundred:", "max_tokens": 24, "ignore_eos": True}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=constrained.url, headers=constrained.headers, timeout=300) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(12)))

    responses = asyncio.run(main())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) >= 1 and statuses.count(200) >= 1, statuses
    refused = next(r for r in responses if r.status_code == 503).json()["error"]
    assert refused["type"] == "overloaded_error" and "max-waiting" in refused["message"]
    r = httpx.post(f"{constrained.url}/v1/completions", json=body, headers=constrained.headers, timeout=300)
    assert r.status_code == 200  # the queue drained: served again


def test_sigterm_drains_and_exits_0(constrained: ServerProcess) -> None:
    """Last in this module: SIGTERM with a stream in flight; the stream finishes, the process exits 0."""
    received: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{constrained.url}/v1/completions", json=body, headers=constrained.headers,
                          timeout=120) as resp:  # fmt: skip
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    received.append(line[6:])
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120)
    assert constrained.stop(timeout=90) == 0, constrained.log_text()
    t.join(30)
    assert received[-1] == "[DONE]"
    texts = [json.loads(x)["choices"][0]["text"] for x in received[:-1]]
    assert sum(bool(x) for x in texts) > 1
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{constrained.url}/health", timeout=5)
