"""A server with an API key, bounded waiting and one sequence at a time: 401, 503, SIGTERM exit 0."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import httpx
import pytest
from server_helpers import ServerProcess, running

KEY = "sk-test-secret"
GUARDED_ARGS = ("--max-model-len", "512", "--max-waiting", "2", "--max-num-seqs", "1", "--drain-timeout", "20")


@pytest.fixture(scope="module")
def guarded() -> Iterator[ServerProcess]:
    yield from running(*GUARDED_ARGS, api_key=KEY)


ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("POST", "/v1/messages", {"model": "", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_api_key_required(guarded: ServerProcess, method: str, path: str, body: dict | None) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, f"{guarded.url}{path}", json=body, headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.request(method, f"{guarded.url}{path}", json=body, headers=guarded.headers, timeout=60)
    assert r.status_code == 200, r.text
    if path == "/v1/messages":
        r = httpx.request(method, f"{guarded.url}{path}", json=body, headers={"x-api-key": KEY}, timeout=60)
        assert r.status_code == 200, r.text


def test_health_and_metrics_need_no_key(guarded: ServerProcess) -> None:
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert httpx.get(f"{guarded.url}/metrics").status_code == 200


def test_overload_answers_503(guarded: ServerProcess) -> None:
    body = {"prompt": "Count to one hundred:", "max_tokens": 24, "ignore_eos": True}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=guarded.url, headers=guarded.headers, timeout=300) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(8)))

    statuses = [r.status_code for r in asyncio.run(main())]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) >= 1 and statuses.count(200) >= 1, statuses
    r = httpx.post(f"{guarded.url}/v1/completions", json=body, headers=guarded.headers, timeout=300)
    assert r.status_code == 200  # the queue drained: served again


def test_sigterm_drains_and_exits_0(guarded: ServerProcess) -> None:
    """Last in this module: SIGTERM with a stream in flight; the stream finishes, the process exits 0."""
    received: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{guarded.url}/v1/completions", json=body, headers=guarded.headers,
                          timeout=120) as resp:  # fmt: skip
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    received.append(line[6:])
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120)
    assert guarded.stop(timeout=90) == 0, guarded.log_text()
    t.join(30)
    assert received[-1] == "[DONE]"
    tokens = sum(len(json.loads(x)["choices"][0]["text"]) > 0 for x in received[:-1])
    assert tokens > 1
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{guarded.url}/health", timeout=5)
