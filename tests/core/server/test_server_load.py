"""Load, disconnects and engine faults: nothing lost, duplicated or leaked; the loop survives."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from server_helpers import ServerProcess

from plinth import SamplingParams
from plinth.server.async_engine import AsyncEngine, EngineError


async def _stream_completion(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, int]:
    """(text, completion tokens) of one streamed completion."""
    text, tokens = "", -1
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                assert choice["index"] == 0
                text += choice["text"]
    return text, tokens


@pytest.mark.slow
def test_64_concurrent_streams(server: ServerProcess, offline_llm: Any) -> None:
    prompts = [f"Request number {i}: the weather today is" for i in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    checked = prompts[::8]  # the offline reference for a sample: the whole batch costs as much as the test
    expected = dict(zip(checked, (o.outputs[0].text for o in offline_llm.generate(checked, params)), strict=True))
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "echo": True,
            "stream_options": {"include_usage": True}}  # fmt: skip

    async def main() -> list[tuple[str, int]]:
        limits = httpx.Limits(max_connections=80)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(_stream_completion(client, {**body, "prompt": p}) for p in prompts))

    results = asyncio.run(main())
    for prompt, (text, tokens) in zip(prompts, results, strict=True):
        assert tokens == 8
        # echo proves the stream is this prompt's own; greedy equality proves nothing was mixed in
        assert text.startswith(prompt)
        if prompt in expected:
            assert text == prompt + expected[prompt]
    assert len({text for text, _ in results}) == 64


def test_disconnects_free_everything(server: ServerProcess) -> None:
    idle = server.metrics()
    assert idle["plinth:num_requests_running"] == 0

    async def disconnect(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 64, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then hang up

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=30)) as c:
            await asyncio.gather(*(disconnect(c, i) for i in range(20)))

    asyncio.run(main())
    deadline = time.monotonic() + 30
    while True:
        m = server.metrics()
        settled = m["plinth:num_requests_running"] == 0 and m["plinth:num_requests_waiting"] == 0
        if settled and m["plinth:kv_cache_usage_perc"] == idle["plinth:kv_cache_usage_perc"]:
            break
        assert time.monotonic() < deadline, f"requests or KV blocks leaked: {m}"
        time.sleep(0.2)
    assert m["plinth:request_success_total"] >= idle.get("plinth:request_success_total", 0) + 20
    # and the server still serves
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_failed_step_fails_its_requests_and_the_loop_survives(offline_llm: Any) -> None:
    """In-process: a step that raises fails the running requests with EngineError; new ones work."""
    engine = offline_llm.engine
    real_execute = engine.runner.execute
    calls = 0

    def flaky(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected kernel failure")
        return real_execute(*args, **kwargs)

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def collect(aengine: AsyncEngine, rid: str) -> Any:
        last = None
        async for out in aengine.generate(rid, "Hello there", params):
            last = out
        return last

    async def main() -> tuple[list[Any], Any]:
        aengine = AsyncEngine(engine)
        await aengine.start()
        try:
            failed = await asyncio.gather(*(collect(aengine, f"r{i}") for i in range(3)), return_exceptions=True)
            ok = await collect(aengine, "after")
            return failed, ok
        finally:
            await aengine.shutdown()
            assert aengine.stats.num_failed_steps_total == 1

    engine.runner.execute = flaky
    try:
        failed, ok = asyncio.run(main())
    finally:
        engine.runner.execute = real_execute
    assert all(isinstance(f, EngineError) for f in failed), failed
    assert ok.finished and len(ok.outputs[0].token_ids) == 6
    assert not engine.has_unfinished() and engine.scheduler.kv_usage == 0.0


def test_cancelled_consumer_aborts(offline_llm: Any) -> None:
    """In-process: breaking out of ``generate`` aborts the request and frees its blocks."""
    engine = offline_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        aengine = AsyncEngine(engine)
        await aengine.start()
        try:
            stream = aengine.generate("x", "Tell me a story", params)
            async for _ in stream:
                break
            await stream.aclose()
            for _ in range(100):
                if aengine.stats.num_running == 0 and not engine.has_unfinished():
                    break
                await asyncio.sleep(0.05)
        finally:
            await aengine.shutdown()

    asyncio.run(main())
    assert not engine.has_unfinished() and engine.scheduler.kv_usage == 0.0
