"""A deliberately tiny KV cache: requests are preempted and recomputed, and still equal greedy."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_helpers import ServerProcess, running

from plinth import SamplingParams

# 7 usable blocks of 16 tokens; 4 requests start in 4 blocks and grow to 3 blocks each (~8 + 28 tokens)
PRESSURE_ARGS = ("--num-kv-blocks", "8", "--max-model-len", "112", "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def pressured() -> Iterator[ServerProcess]:
    yield from running(*PRESSURE_ARGS)


@pytest.mark.slow
def test_preempted_requests_complete_with_greedy_outputs(pressured: ServerProcess, offline_llm: Any) -> None:
    prompts = [f"Fact {i}: the tallest mountain" for i in range(4)]
    expected = offline_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True))

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=pressured.url, timeout=600) as client:
            body = {"max_tokens": 28, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json={**body, "prompt": p}) for p in prompts))

    responses = asyncio.run(main())
    for resp, ref in zip(responses, expected, strict=True):
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["usage"]["completion_tokens"] == 28
        assert out["choices"][0]["text"] == ref.outputs[0].text
    m = pressured.metrics()
    assert m["plinth:num_preemptions_total"] > 0
    assert m["plinth:num_requests_running"] == 0 and m["plinth:kv_cache_usage_perc"] == 0.0
