"""``plinth serve --tensor-parallel-size 2``, ``--pipeline-parallel-size 2`` and both: the single-process
server's tokens over HTTP; a worker
killed mid-stream ends every client's request visibly within a bounded time and the server exits
non-zero, never hanging."""

from __future__ import annotations

import os
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
    """The server's worker processes (its direct children)."""
    with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
        return [int(p) for p in f.read().split()]


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
