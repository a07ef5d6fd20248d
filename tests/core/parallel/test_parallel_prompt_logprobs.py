"""Prompt logprobs under tensor parallelism (every rank's LM head joins the all-gather; rank 0 scores)
equal the single process's; pipeline parallelism refuses them by name and keeps serving."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tensor_parallel import ENGINE, LOGPROB_TOL

from plinth import LLM, SamplingParams
from plinth.runtime.engine import InvalidRequest
from plinth_conformance.tiny_models import prompts, save_tiny_model

SCORED = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)


@pytest.mark.slow
def test_tensor_parallel_prompt_logprobs_equal_the_single_process(tmp_path: Path) -> None:
    folder = save_tiny_model("llama", tmp_path / "llama")
    batch = prompts(0, (9, 70, 33))  # 70 tokens: two chunks of the 64-token budget
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    mixed = [SCORED, plain, SCORED]
    want = LLM(model=str(folder), **ENGINE).generate(batch, mixed)
    llm = LLM(model=str(folder), tensor_parallel_size=2, **ENGINE)
    try:
        got = llm.generate(batch, mixed)
    finally:
        llm.engine.close()
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        if w.prompt_logprobs is None:
            assert g.prompt_logprobs is None
            continue
        assert g.prompt_logprobs is not None and g.prompt_logprobs[0] is None
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            assert a is not None and b is not None and a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=LOGPROB_TOL)
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=LOGPROB_TOL)


@pytest.mark.slow
def test_pipeline_parallel_refuses_prompt_logprobs_and_keeps_serving(tmp_path: Path) -> None:
    folder = save_tiny_model("llama", tmp_path / "llama")
    llm = LLM(model=str(folder), pipeline_parallel_size=2, **ENGINE)
    try:
        with pytest.raises(InvalidRequest, match="prompt_logprobs") as info:
            llm.engine.add_request("scored", [5, 6, 7], SCORED)
        assert info.value.param == "prompt_logprobs"
        [out] = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))
        assert len(out.outputs[0].token_ids) == 2
    finally:
        llm.engine.close()
