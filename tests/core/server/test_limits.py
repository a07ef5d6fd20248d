"""Oversized and fanned-out requests against the main server: refused fast, in the OpenAI error
shape, while the event loop keeps serving everyone else (streams flow, /health answers)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
from server_helpers import ServerProcess

BIG = 20 * 1024 * 1024  # over the default --max-request-bytes (16 MiB)


class StreamWatch:
    """A long stream in a thread, recording when each chunk arrived."""

    def __init__(self, server: ServerProcess) -> None:
        self.times: list[float] = []
        self.done = False
        self.started = threading.Event()
        body = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "stream": True}
        self.thread = threading.Thread(target=self._run, args=(server, body))
        self.thread.start()
        assert self.started.wait(120)

    def _run(self, server: ServerProcess, body: dict[str, object]) -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    self.times.append(time.monotonic())
                    self.started.set()
        self.done = True

    def max_gap(self, since: float) -> float:
        """The longest wait between chunks after ``since``."""
        times = [since] + [t for t in self.times if t > since]
        return max(b - a for a, b in zip(times, times[1:], strict=False)) if len(times) > 1 else 0.0


def _health_latency(server: ServerProcess) -> float:
    t0 = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
    return time.monotonic() - t0


def _chunks(data: bytes, size: int = 1 << 20) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def _big_requests(server: ServerProcess, statuses: list[tuple[str, int, str | None]]) -> None:
    """Large requests, each refused: 20 MB bodies (with and without Content-Length) and 12 MB prompts
    (under the body limit, far over the context: refused after tokenizing a prefix only)."""
    payload = b'{"prompt": "' + b"a" * BIG + b'"}'
    text = "word " * (12 * 1024 * 1024 // 5)
    chat = [{"role": "user", "content": text}]
    json_ct = {"content-type": "application/json"}
    with server.client() as http:
        for name, send in [
            ("tokenize-20MB", lambda: http.post("/tokenize", content=payload, headers=json_ct)),
            ("chunked-20MB", lambda: http.post("/v1/completions", content=_chunks(payload), headers=json_ct)),
            ("tokenize-12MB", lambda: http.post("/tokenize", json={"prompt": text})),
            ("completion-12MB", lambda: http.post("/v1/completions", json={"prompt": text})),
            ("chat-12MB", lambda: http.post("/v1/chat/completions", json={"messages": chat})),
            (
                "anthropic-12MB",
                lambda: http.post("/v1/messages", json={"model": "", "max_tokens": 4, "messages": chat}),
            ),
        ]:
            r = send()
            err = r.json()["error"]
            assert isinstance(err["message"], str) and err["code"] == r.status_code, r.text
            statuses.append((name, r.status_code, err["param"]))


def test_large_requests_are_refused_while_streams_keep_flowing(server: ServerProcess) -> None:
    watch = StreamWatch(server)
    t0 = time.monotonic()
    statuses: list[tuple[str, int, str | None]] = []
    t = threading.Thread(target=_big_requests, args=(server, statuses))
    t.start()
    health = [_health_latency(server)]
    while t.is_alive():
        health.append(_health_latency(server))
        time.sleep(0.1)
    t.join()
    took = time.monotonic() - t0
    watch.thread.join(120)
    assert watch.done
    assert statuses == [
        ("tokenize-20MB", 413, None),
        ("chunked-20MB", 413, None),
        ("tokenize-12MB", 400, "prompt"),
        ("completion-12MB", 400, "prompt"),
        ("chat-12MB", 400, "messages"),
        ("anthropic-12MB", 400, "messages"),
    ], statuses
    gap = watch.max_gap(t0)
    print(f"\n6 large requests refused in {took:.2f} s; max stream gap {gap:.2f} s, max /health {max(health):.2f} s")
    # before: the event loop tokenized on its own thread, and every stream stalled for 9-15 s
    assert max(health) < 2.0 and gap < 2.5, (health, gap)


def test_fan_out_is_capped(server: ServerProcess) -> None:
    with server.client() as http:
        t0 = time.monotonic()
        r = http.post("/v1/completions", json={"prompt": ["a"] * 256, "n": 64, "max_tokens": 1})
        assert r.status_code == 400, r.text
        assert time.monotonic() - t0 < 5
        err = r.json()["error"]
        assert err["param"] == "n" and "16384" in err["message"] and "limit of 64" in err["message"], err
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 65})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        # under the cap (prompts x n <= --max-num-seqs, 64 by default): served
        r = http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 3, "max_tokens": 1, "temperature": 1.0})
        assert r.status_code == 200, r.text
        assert sorted(c["index"] for c in r.json()["choices"]) == list(range(6))
