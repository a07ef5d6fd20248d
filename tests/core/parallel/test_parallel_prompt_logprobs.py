"""Prompt logprobs under tensor parallelism (every rank's LM head joins the all-gather; rank 0 scores)
and pipeline parallelism (the last stage scores and sends the scores packed to rank 0) equal the
single process's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_tensor_parallel import ENGINE, LOGPROB_TOL

from plinth import LLM, SamplingParams
from plinth_conformance.tiny_models import prompts, save_tiny_model

SCORED = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)


def _assert_same(got: list[Any], want: list[Any]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        if w.prompt_logprobs is None:
            assert g.prompt_logprobs is None
            continue
        assert g.prompt_logprobs is not None and g.prompt_logprobs[0] is None
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            assert a is not None and b is not None and (a.token_id, a.rank) == (b.token_id, b.rank)
            assert a.logprob == pytest.approx(b.logprob, abs=LOGPROB_TOL)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=LOGPROB_TOL)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "pp"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2: the last stage scores, sends packed", "tp2xpp2"]
)
def test_parallel_prompt_logprobs_equal_the_single_process(tmp_path: Path, tp: int, pp: int) -> None:
    folder = save_tiny_model("llama", tmp_path / "llama")
    batch = prompts(0, (9, 70, 33, 20))  # 70 tokens: two chunks of the 64-token budget
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    top0 = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    mixed = [SCORED, plain, SCORED, top0]  # micro-batches with and without scoring chunks
    want = LLM(model=str(folder), **ENGINE).generate(batch, mixed)
    llm = LLM(model=str(folder), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    try:
        _assert_same(llm.generate(batch, mixed), want)
    finally:
        llm.engine.close()
