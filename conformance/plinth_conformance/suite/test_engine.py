"""The whole engine on tiny models.

Random models (:mod:`plinth_conformance.tiny_models`, one per architecture): greedy decoding
equals the reference backend's, and a request's output does not depend on batch composition, chunk
size or prefix-cache hits. Tokens are compared exactly up to the first divergence; there, both
tokens must be in each side's top-5 and their logprobs within :func:`tie_tolerance` of each other on
both sides (a near tie, which legitimately changes everything after it); anything else fails with
both continuations.

The induction models (:mod:`plinth_conformance.induction`): the greedy tokens must be the context's
continuation (the reference backend too: that checks the construction), and every step's top-5
logprobs the reference's within :func:`logprob_tolerance`, in float32 (the mandatory dtype) on both
sides. ``forks-and-prefix-hits`` runs ``n = 2`` completions that share a partial prompt block (the
engine copies it on the first decode: ``copy_blocks``) and a request whose long prefix is already
cached, and checks both the same way.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from plinth.platform.backend import Backend
from plinth_conformance import induction
from plinth_conformance.cases import EngineCase
from plinth_conformance.plugin import SuiteState
from plinth_conformance.tiny_models import prompts, save_tiny_model

MAX_TOKENS = 12
TOP = 5
#: A shared prefix of two blocks and a bit, so the second run of the same prompts hits the cache.
PREFIX_LEN = 37
#: Logprob tolerances in units of ``eps(dtype) * LOGIT_SCALE``, see :func:`logprob_tolerance`.
TIE_EPS = 32.0
LOGPROB_EPS = 64.0
#: The largest logit or attention score of the models, in nats (the induction model's previous-token
#: score, ``16 * PREV_MARGIN / prev_token_margin()`` = 255; the random models' margins are 15-75):
#: rounding errors are relative to it.
LOGIT_SCALE = 256.0


def tie_tolerance(dtype: str) -> float:
    """How far apart two tokens' logprobs may be and still count as a near tie: ``TIE_EPS`` times
    ``eps(dtype) * LOGIT_SCALE`` (a logit is a sum of terms of up to ``LOGIT_SCALE`` nats, each
    rounded in ``dtype``; fp32: 9.8e-4 nats; bf16: 64 nats, where only both tokens in the top-5 rules)."""
    return TIE_EPS * float(torch.finfo(getattr(torch, dtype)).eps) * LOGIT_SCALE


def logprob_tolerance(dtype: str) -> float:
    """How far a logprob may be from the reference's: ``LOGPROB_EPS * eps(dtype) * LOGIT_SCALE``.

    A logprob is ``logit - logsumexp(logits)``; each logit and each attention score behind it is a
    reduction of terms of at most ``LOGIT_SCALE`` nats, so an implementation that rounds in
    ``dtype`` moves it by some ``eps(dtype) * LOGIT_SCALE`` per rounding step; ``LOGPROB_EPS`` allows
    the steps of two layers' GEMMs, norms and softmaxes (fp32: 2.0e-3 nats; the cpu backend is
    measured within 3.1e-5 of the reference, one fp32 ulp of a 256-nat score; a window one key short
    moves them by 0.02-0.04)."""
    return LOGPROB_EPS * float(torch.finfo(getattr(torch, dtype)).eps) * LOGIT_SCALE


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``tiny_model(name)``: the folder of a tiny random model, built once per module."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            folder = tmp_path_factory.mktemp(name)
            if name in induction.MODELS:
                built[name] = induction.save_induction_model(name, folder)
            else:
                built[name] = save_tiny_model(name, folder)
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


def divergence(mine: Any, other: Any, tie: float = math.inf) -> str | None:
    """None when two completions agree up to a near tie (both tokens in each side's top-5, their
    logprobs within ``tie`` nats on both sides); else where and how they differ."""
    a, b = mine.outputs[0], other.outputs[0]
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)):
        if x == y:
            continue
        top_a = dict(a.logprobs[i].top) if a.logprobs else {}
        top_b = dict(b.logprobs[i].top) if b.logprobs else {}
        if x in top_b and y in top_a and y in top_b and x in top_a:
            gaps = (abs(top_a[x] - top_a[y]), abs(top_b[x] - top_b[y]))
            if max(gaps) <= tie:
                return None  # a near tie: everything after it may differ
            return (
                f"token {i}: {x} vs {y}, no near tie (logprob gaps {gaps[0]:.3g} and {gaps[1]:.3g} nats > {tie:.3g}); "
                f"{a.token_ids} vs {b.token_ids}"
            )
        return f"token {i}: {x} vs {y} (top-{TOP}: {top_a} vs {top_b}); {a.token_ids} vs {b.token_ids}"
    if len(a.token_ids) != len(b.token_ids):
        return f"{len(a.token_ids)} tokens vs {len(b.token_ids)}"
    return None


def _check(case_id: str, label: str, mine: list[Any], other: list[Any], tie: float) -> list[str]:
    return [
        f"prompt {i} {label}: {d}"
        for i, (m, o) in enumerate(zip(mine, other, strict=True))
        if (d := divergence(m, o, tie)) is not None
    ]


def test_engine(plinth_backend: Backend, plinth_state: SuiteState, engine_case: EngineCase, tiny_model: Any) -> None:
    """Greedy tokens match the reference backend, or do not depend on how requests are batched."""
    case = engine_case
    if case.model in induction.MODELS:
        _induction(plinth_backend, plinth_state, case, tiny_model(case.model))
        return
    folder = tiny_model(case.model)
    name = plinth_backend.name
    batch = _prompts(case)
    params = _params()
    mine = _llm(plinth_state, folder, name, case.block_size)
    tie = tie_tolerance(plinth_backend.device_services().default_dtype())  # the dtype LLM() runs in without one
    problems: list[str] = []
    if case.check == "greedy-vs-reference":
        if name == "reference":
            pytest.skip("the reference backend is the oracle of this check")
        ref = _llm(plinth_state, folder, "reference", case.block_size, dtype="float32")
        problems = _check(case.id, "vs reference", mine.generate(batch, params), ref.generate(batch, params), tie)
    else:
        alone = [mine.generate(p, params)[0] for p in batch]
        together = mine.generate(batch, params)
        problems += _check(case.id, "batched vs alone", together, alone, tie)
        again = mine.generate(batch, params)  # the shared prefix's full blocks are cached now
        assert any(o.metrics.num_cached_prompt_tokens > 0 for o in again), f"[{case.id}] no prefix-cache hit"
        problems += _check(case.id, "with prefix-cache hits vs alone", again, alone, tie)
        chunked = _llm(plinth_state, folder, name, case.block_size, max_num_batched_tokens=16)
        problems += _check(
            case.id, "chunked prefill (16-token budget) vs alone", chunked.generate(batch, params), alone, tie
        )
    assert not problems, f"[{case.id}] " + "; ".join(problems)


# -- the induction models -----------------------------------------------------------------------------

#: (period, length) of the induction prompts: around the block size, several blocks, a long one.
INDUCTION_PROMPTS: tuple[tuple[int, int], ...] = ((5, 9), (8, 17), (20, 48), (63, 150), (24, 40))
#: The sliding-window model's: periods up to the window (at the window, the match is its last key).
INDUCTION_SW_PROMPTS: tuple[tuple[int, int], ...] = ((5, 9), (8, 17), (20, 48), (23, 150), (24, 100))


def _induction_prompts(case: EngineCase) -> list[tuple[int, list[int]]]:
    shapes = INDUCTION_SW_PROMPTS if case.model == "induction-sw" else INDUCTION_PROMPTS
    return [(period, induction.cyclic_prompt(case.seed + i, period, n)) for i, (period, n) in enumerate(shapes)]


def logprob_problems(mine: Any, ref: Any, tol: float) -> list[str]:
    """Where the step-by-step top-5 logprobs of two completions differ by more than ``tol``: the
    chosen token's, and the top-5 values in order (runner-up token ids may tie, their values not)."""
    problems = []
    for step, (a, b) in enumerate(zip(mine.logprobs or [], ref.logprobs or [], strict=False)):
        pairs = [(a.logprob, b.logprob)] + list(
            zip(
                sorted((lp for _, lp in a.top), reverse=True),
                sorted((lp for _, lp in b.top), reverse=True),
                strict=False,
            )
        )
        worst = max(abs(x - y) for x, y in pairs)
        if worst > tol:
            problems.append(
                f"step {step}: logprobs differ by {worst:.3g} nats > {tol:.3g} ({a.top[:3]} vs {b.top[:3]})"
            )
            break
    if mine.logprobs is None or ref.logprobs is None:
        problems.append("no logprobs returned")
    return problems


def _compare(label: str, expected: list[int], mine: Any, ref: Any, tol: float) -> list[str]:
    """Both completions must be ``expected``, their logprobs within ``tol``."""
    out = []
    if ref.token_ids != expected:
        out.append(f"{label}: the reference backend gave {ref.token_ids}, not the continuation {expected} (suite bug)")
    if mine.token_ids != expected:
        out.append(f"{label}: tokens {mine.token_ids}, expected the context's continuation {expected}")
    out += [f"{label}: {p}" for p in logprob_problems(mine, ref, tol)]
    return out


def _induction(backend: Backend, state: SuiteState, case: EngineCase, folder: Path) -> None:
    """The context's continuation, with the reference's logprobs (float32 on both sides)."""
    from plinth import SamplingParams

    name = backend.name
    tol = logprob_tolerance("float32")
    mine = _llm(state, folder, name, case.block_size, dtype="float32")
    ref = mine if name == "reference" else _llm(state, folder, "reference", case.block_size, dtype="float32")
    params = _params()
    problems: list[str] = []
    if case.check == "copy-vs-reference":
        batch = _induction_prompts(case)
        prompts_only = [p for _, p in batch]
        got, want = mine.generate(prompts_only, params), ref.generate(prompts_only, params)
        for i, ((period, prompt), m, r) in enumerate(zip(batch, got, want, strict=True)):
            expected = induction.continuation(prompt, period, MAX_TOKENS)
            problems += _compare(
                f"prompt {i} (period {period}, {len(prompt)} tokens)", expected, m.outputs[0], r.outputs[0], tol
            )
    else:
        # two completions of one prompt whose last block is partial: both forks append to it
        period, length = (20, 3 * case.block_size + 5)
        prompt = induction.cyclic_prompt(case.seed, period, length)
        expected = induction.continuation(prompt, period, MAX_TOKENS)
        forked = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
        single = ref.generate([prompt], params)[0].outputs[0]
        outs = mine.generate([prompt], forked)[0].outputs
        if len(outs) != 2:
            problems.append(f"n=2 returned {len(outs)} completions")
        for j, o in enumerate(outs):
            problems += _compare(f"fork {j} of n=2", expected, o, single, tol)
        # a long prompt, then one sharing its first blocks: the second's prefix is a cache hit
        period, length = (23, 6 * case.block_size + 3)
        first = induction.cyclic_prompt(case.seed + 1, period, length)
        second = first[: 5 * case.block_size + 2]
        for label, prompt in (("prefix owner", first), ("prefix-cache hit", second)):
            m = mine.generate([prompt], params)[0]
            r = _llm(state, folder, "reference", case.block_size, dtype="float32").generate([prompt], params)[0]
            expected = induction.continuation(prompt, period, MAX_TOKENS)
            problems += _compare(label, expected, m.outputs[0], r.outputs[0], tol)
            if label == "prefix-cache hit" and m.metrics.num_cached_prompt_tokens < 4 * case.block_size:
                problems.append(f"{label}: only {m.metrics.num_cached_prompt_tokens} prompt tokens came from the cache")
    assert not problems, f"[{case.id}] " + "; ".join(problems)
