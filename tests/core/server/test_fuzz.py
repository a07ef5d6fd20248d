"""A bounded schemathesis fuzz of the server's OpenAPI document: no 5xx, and the server lives on.

Uses schemathesis's Python API (``schemathesis.openapi.from_url`` + ``APIOperation.as_strategy``)
driven by Hypothesis inside one test: the lazy ``schemathesis.pytest.from_fixture`` route needs the
schema at collection time or pytest internals that pytest 9 no longer has.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from server_helpers import ServerProcess

FUZZ_BUDGET_S = 40.0  # the whole fuzz run
EXAMPLES = {GenerationMode.POSITIVE: 4, GenerationMode.NEGATIVE: 3}  # per operation
_SMALL = {"max_tokens": 2, "max_completion_tokens": 2, "n": 2, "logprobs": 2, "top_logprobs": 2}


def _shrink(body: Any) -> None:
    """Keep generated requests cheap: few tokens, few sequences, few prompts or inputs."""
    if not isinstance(body, dict):
        return
    for key, cap in _SMALL.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap
    for key in ("prompt", "input"):  # completions' prompts, embeddings' inputs
        prompt = body.get(key)
        if isinstance(prompt, list) and len(prompt) > 2 and not isinstance(prompt[0], int):
            body[key] = prompt[:2]


@pytest.mark.slow
def test_fuzz_no_server_errors(server: ServerProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 9
    deadline = time.monotonic() + FUZZ_BUDGET_S
    failures: list[str] = []
    calls = 0

    for operation in operations:
        for mode, examples in EXAMPLES.items():

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.generate],
                database=None,
            )
            def run(case: Any) -> None:
                nonlocal calls
                if time.monotonic() > deadline:
                    return
                _shrink(case.body)
                response = case.call(base_url=server.url, timeout=120)
                calls += 1
                if response.status_code >= 500:
                    failures.append(
                        f"{case.method} {case.path} {case.body!r}: {response.status_code} {response.text[:300]}"
                    )

            try:
                run()
            except Unsatisfiable:
                assert mode is GenerationMode.NEGATIVE  # nothing to get wrong (GET /health)
    assert not failures, "\n".join(failures[:10])
    assert calls >= len(operations)  # the budget let every operation be called at least once
    # alive and clean afterwards
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert server.metrics()["plinth:engine_step_failures_total"] == 0
