"""``plinth serve --tensor-parallel-size 2``, ``--pipeline-parallel-size 2`` and both: the single-process
server's tokens over HTTP; a worker
killed mid-stream ends every client's request visibly within a bounded time and the server exits
non-zero, never hanging."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import start_server

from plinth_conformance.tiny_models import save_tiny_model

ARGS = ("--backend", "cpu", "--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-seqs", "4")


def _children(pid: int) -> list[int]:
    """The server's worker processes (its direct children, whichever of its threads started them: a
    restart starts them from the engine thread), in start order."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(p) for p in (task / "children").read_text(encoding="ascii").split()]
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return sorted(found, key=lambda child: int(Path(f"/proc/{child}/stat").read_text().split()[21]))


def _completion(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [("-tp", "2"), ("-pp", "2"), ("-tp", "2", "-pp", "2")],
    ids=["tp2", "pp2", "tp2xpp2"],
)
def test_ranks_serve_the_single_process_tokens_and_a_dead_worker_stops_it_non_zero(
    flags: tuple[str, ...], tmp_path: Path
) -> None:
    folder = save_tiny_model("llama", tmp_path / "tiny")
    prompt = list(range(5, 40))
    one = start_server("--model", str(folder), "--served-model-name", "tiny", *ARGS)
    try:
        want = _completion(one.url, prompt, 16)
    finally:
        one.stop()
    two = start_server("--model", str(folder), "--served-model-name", "tiny", *flags, *ARGS)
    try:
        assert _completion(two.url, prompt, 16) == want
        workers = _children(two.proc.pid)
        assert len(workers) == 2 ** (len(flags) // 2) - 1  # rank 1 is workers[0]
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": True}
            try:
                with httpx.stream("POST", f"{two.url}/v1/completions", json=body, timeout=60) as resp:
                    for line in resp.iter_lines():
                        if line:
                            events.append(line)
                            started.set()
            except httpx.HTTPError as exc:
                events.append(f"!{type(exc).__name__}")
            finally:
                started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        reader.join(30)
        assert not reader.is_alive(), "the stream hung after its worker died"
        ended = time.monotonic() - t0
        assert any("the engine stopped" in e for e in events), events[-3:]  # an in-band error, not a silent cut
        code = two.proc.wait(30)
        assert code != 0 and ended < 30
        assert "the engine stopped" in two.log_text() and "rank 1" in two.log_text()
    finally:
        if two.proc.poll() is None:
            two.proc.kill()


def _until_healthy(url: str, timeout_s: float) -> float:
    """Seconds until ``/health`` answers 200 (it answers 503 while the engine restarts)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not healthy again within {timeout_s} s")


@pytest.mark.slow
def test_restart_workers_fails_the_requests_held_then_serves_again_until_the_restarts_run_out(
    tmp_path: Path,
) -> None:
    """``--restart-workers 1``: a killed worker fails the request in flight, the workers start again
    (new processes) and the next request gets the same tokens; a second failure ends the server non-zero."""
    folder = save_tiny_model("llama", tmp_path / "tiny")
    prompt = list(range(5, 40))
    server = start_server(
        "--model", str(folder), "--served-model-name", "tiny", "-tp", "2", "--restart-workers", "1", *ARGS
    )
    try:
        want = _completion(server.url, prompt, 16)
        first = _children(server.proc.pid)
        os.kill(first[0], signal.SIGKILL)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
        failed = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert failed.status_code in (500, 503), failed.text  # the step failed, or the restart was under way
        assert _until_healthy(server.url, 60) < 60
        assert server.proc.poll() is None
        second = _children(server.proc.pid)
        assert len(second) == 1 and second != first  # a new worker process
        assert _completion(server.url, prompt, 16) == want
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert re.search(r"^plinth:engine_restarts_total\{[^}]*\} 1\.0$", metrics, re.M), metrics[-2000:]
        os.kill(second[0], signal.SIGKILL)  # no restart left
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert server.proc.wait(30) != 0
        assert "restarting the engine (1 of 1)" in server.log_text()
        assert "the engine stopped" in server.log_text()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
