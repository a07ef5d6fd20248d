"""The whole engine on tiny random models: greedy decoding equals the reference backend's, and a
request's output does not depend on batch composition, chunk size or prefix-cache hits.

Tokens are compared exactly up to the first divergence; there, each side's token must be in the
other's top-5 logprobs (a near tie, which legitimately changes everything after it); anything else
fails with both continuations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plinth.platform.backend import Backend
from plinth_conformance.cases import EngineCase
from plinth_conformance.plugin import SuiteState
from plinth_conformance.tiny_models import prompts, save_tiny_model

MAX_TOKENS = 12
TOP = 5
#: A shared prefix of two blocks and a bit, so the second run of the same prompts hits the cache.
PREFIX_LEN = 37


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``tiny_model(name)``: the folder of a tiny random model, built once per module."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = save_tiny_model(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get


def _prompts(case: EngineCase) -> list[list[int]]:
    """Lengths around the block size, a long one, and two that share a multi-block prefix."""
    b = case.block_size
    short = prompts(case.seed, (1, max(b - 1, 2), b + 1, 3 * b))
    prefix, tail_a, tail_b = prompts(case.seed + 1, (PREFIX_LEN, 1, b + 1))
    return [*short, prefix + tail_a, prefix + tail_b]


def _llm(state: SuiteState, folder: Path, backend: str, block_size: int, **kwargs: Any) -> Any:
    from plinth import LLM

    return LLM(
        model=str(folder),
        backend=backend,
        host=state.host,
        block_size=block_size,
        num_kv_blocks=256,
        max_model_len=256,
        **kwargs,
    )


def _params() -> Any:
    from plinth import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)


def divergence(mine: Any, other: Any) -> str | None:
    """None when two completions agree up to a near tie; else where and how they differ."""
    a, b = mine.outputs[0], other.outputs[0]
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
        if x == y:
            continue
        top_a = [t for t, _ in a.logprobs[i].top] if a.logprobs else []
        top_b = [t for t, _ in b.logprobs[i].top] if b.logprobs else []
        if x in top_b and y in top_a:
            return None  # a near tie: everything after it may differ
        return f"token {i}: {x} vs {y} (top-{TOP}: {top_a} vs {top_b}); {a.token_ids} vs {b.token_ids}"
    if len(a.token_ids) != len(b.token_ids):
        return f"{len(a.token_ids)} tokens vs {len(b.token_ids)}"
    return None


def _check(case_id: str, label: str, mine: list[Any], other: list[Any]) -> list[str]:
    return [
        f"prompt {i} {label}: {d}"
        for i, (m, o) in enumerate(zip(mine, other, strict=True))
        if (d := divergence(m, o)) is not None
    ]


def test_engine(plinth_backend: Backend, plinth_state: SuiteState, engine_case: EngineCase, tiny_model: Any) -> None:
    """Greedy tokens match the reference backend, or do not depend on how requests are batched."""
    case = engine_case
    folder = tiny_model(case.model)
    name = plinth_backend.name
    batch = _prompts(case)
    params = _params()
    mine = _llm(plinth_state, folder, name, case.block_size)
    problems: list[str] = []
    if case.check == "greedy-vs-reference":
        if name == "reference":
            pytest.skip("the reference backend is the oracle of this check")
        ref = _llm(plinth_state, folder, "reference", case.block_size, dtype="float32")
        problems = _check(case.id, "vs reference", mine.generate(batch, params), ref.generate(batch, params))
    else:
        alone = [mine.generate(p, params)[0] for p in batch]
        together = mine.generate(batch, params)
        problems += _check(case.id, "batched vs alone", together, alone)
        again = mine.generate(batch, params)  # the shared prefix's full blocks are cached now
        assert any(o.metrics.num_cached_prompt_tokens > 0 for o in again), f"[{case.id}] no prefix-cache hit"
        problems += _check(case.id, "with prefix-cache hits vs alone", again, alone)
        chunked = _llm(plinth_state, folder, name, case.block_size, max_num_batched_tokens=16)
        problems += _check(
            case.id, "chunked prefill (16-token budget) vs alone", chunked.generate(batch, params), alone
        )
    assert not problems, f"[{case.id}] " + "; ".join(problems)
