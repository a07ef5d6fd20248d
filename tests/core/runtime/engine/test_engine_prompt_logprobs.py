"""Prompt logprobs (``SamplingParams.prompt_logprobs``) equal transformers' log-softmax of the logits
at every prompt position, whatever the chunking, the prefix cache or the batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import save_tiny_folder

from plinth import LLM, SamplingParams
from plinth.runtime.outputs import RequestOutput, TokenLogprob
from plinth.runtime.parts import InvalidRequest
from plinth.validation import InvalidParameter

BACKENDS = ["reference", "cpu"]
#: fp32 on both sides; the cpu backend's GEMMs sum in another order than torch's: measured
#: differences are ~1e-6 (reference) and ~1e-5 (cpu) on logprobs of size ~10
ATOL = 1e-4
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
    "A",
    "1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584",
]
TOP = 5
PARAMS = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("llama")
    return folder, save_tiny_folder("llama", folder)


def hf_prompt_logprobs(hf: Any, prompt: list[int]) -> torch.Tensor:
    """transformers' fp32 log-softmax at every prompt position: [P, V] (row p predicts token p + 1)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_matches(out: RequestOutput, reference: torch.Tensor, top: int = TOP) -> None:
    """``out.prompt_logprobs`` against the reference rows: the prompt token's logprob and rank, the top-n."""
    prompt = out.prompt_token_ids
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for p in range(1, len(prompt)):
        entry = got[p]
        assert isinstance(entry, TokenLogprob), f"position {p} not scored"
        row = reference[p - 1]
        assert entry.token_id == prompt[p]
        assert entry.logprob == pytest.approx(float(row[prompt[p]]), abs=ATOL), f"position {p}"
        # the rank counts the tokens above this one: those within the tolerance of it may fall on either
        # side (at rank ~1900 of 49152 random logits, neighbours ~1e-5 apart: seen at 1919 vs 1918)
        value = float(row[prompt[p]])
        surely_above, maybe_above = int((row > value + ATOL).sum()), int((row > value - ATOL).sum())
        assert surely_above + 1 <= entry.rank <= maybe_above, f"position {p}: rank {entry.rank}"  # (itself counted)
        values, ids = row.topk(top)
        assert len(entry.top) == top
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=ATOL)
        # ids may swap only where two values tie within the tolerance
        for (tok, _), want, value in zip(entry.top, ids.tolist(), values.tolist(), strict=True):
            assert tok == want or abs(float(row[tok]) - value) <= ATOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logprobs_match_transformers(tiny: tuple[Path, Any], backend: str) -> None:
    folder, hf = tiny
    llm = LLM(model=str(folder), backend=backend, num_kv_blocks=256, block_size=16)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, PARAMS)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches(out, hf_prompt_logprobs(hf, prompt))


def test_chunked_prefill_prefix_hits_and_batching_give_the_same_numbers(tiny: tuple[Path, Any]) -> None:
    folder, hf = tiny
    llm = LLM(model=str(folder), backend="cpu", num_kv_blocks=256, block_size=16)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    refs = [hf_prompt_logprobs(hf, p) for p in prompts]
    one_chunk = [llm.generate([p], PARAMS)[0] for p in prompts]  # alone, each prompt in one chunk

    # 16 tokens a step for the four prompts: all but "A" are scored over several chunks
    chunked = LLM(model=str(folder), backend="cpu", num_kv_blocks=256, block_size=16, max_num_batched_tokens=16)
    for out, ref, alone in zip(chunked.generate(prompts, PARAMS), refs, one_chunk, strict=True):
        assert_matches(out, ref)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids

    # the engine has them all in its prefix cache now: plain requests hit, scoring ones do not
    plain = SamplingParams(temperature=0, max_tokens=3)
    warm = llm.generate(prompts, plain)
    assert sum(o.metrics.num_cached_prompt_tokens for o in warm) > 0
    assert all(o.prompt_logprobs is None for o in warm)
    again = llm.generate(prompts, PARAMS)
    assert [o.metrics.num_cached_prompt_tokens for o in again] == [0] * len(prompts)
    for out, ref in zip(again, refs, strict=True):
        assert_matches(out, ref)

    # a batch mixing requests with and without: the others' tokens do not change
    mixed = llm.generate(prompts, [PARAMS if i % 2 else plain for i in range(len(prompts))])
    for i, (out, ref, alone) in enumerate(zip(mixed, refs, one_chunk, strict=True)):
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        if i % 2:
            assert_matches(out, ref)
        else:
            assert out.prompt_logprobs is None


def test_n_completions_share_one_prompt_logprobs_and_top_0_gives_the_token_only(tiny: tuple[Path, Any]) -> None:
    folder, hf = tiny
    llm = LLM(model=str(folder), backend="reference", num_kv_blocks=256, block_size=16)
    prompt = llm.tokenizer.encode(PROMPTS[1])
    ref = hf_prompt_logprobs(hf, prompt)
    [out] = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=2))
    assert len(out.outputs) == 3
    assert_matches(out, ref, top=2)
    [zero] = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert zero.prompt_logprobs is not None and all(e is None or e.top == [] for e in zero.prompt_logprobs)
    assert zero.prompt_logprobs[1] is not None
    assert zero.prompt_logprobs[1].logprob == pytest.approx(float(ref[0, prompt[1]]), abs=ATOL)


def test_with_speculative_decoding_and_structured_output(tiny: tuple[Path, Any]) -> None:
    from plinth.sampling_params import StructuredOutputs

    folder, hf = tiny
    # a repetitive prompt: the n-gram drafter proposes, so steps with drafts run beside prompt chunks
    spec = LLM(
        model=str(folder),
        backend="cpu",
        num_kv_blocks=256,
        block_size=16,
        num_speculative_tokens=3,
        max_num_batched_tokens=16,
    )
    prompts = [spec.tokenizer.encode(p) for p in (PROMPTS[3], PROMPTS[0])]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    params = [plain, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP)]
    outs = spec.generate(prompts, params)
    assert spec.engine.scheduler.spec_stats.num_draft_tokens > 0, "no step had drafts"
    assert_matches(outs[1], hf_prompt_logprobs(hf, prompts[1]))
    choice = SamplingParams(
        temperature=0, max_tokens=8, prompt_logprobs=1, structured=StructuredOutputs(choice=["yes", "no"])
    )
    [constrained] = spec.generate([prompts[0]], choice)
    assert constrained.outputs[0].text in ("yes", "no")
    assert_matches(constrained, hf_prompt_logprobs(hf, prompts[0]), top=1)


def test_bad_values_name_the_field() -> None:
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(InvalidParameter, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20


def test_static_shape_steps_refuse_and_keep_serving(tiny: tuple[Path, Any]) -> None:
    from test_static_steps import StaticReference, _engine

    folder, _ = tiny
    engine = _engine(folder, StaticReference(), max_num_batched_tokens=16)
    with pytest.raises(InvalidRequest, match="prompt_logprobs") as info:
        engine.add_request("scored", [5, 9, 13], SamplingParams(prompt_logprobs=1))
    assert info.value.param == "prompt_logprobs"
    engine.add_request("plain", [5, 9, 13], SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished():
        engine.step()


def test_a_request_preempted_mid_prompt_scores_it_again_from_position_0(tiny: tuple[Path, Any]) -> None:
    folder, hf = tiny
    # 8 usable blocks of 16: the decoding request's growth preempts the scoring one mid-prompt
    llm = LLM(model=str(folder), backend="reference", num_kv_blocks=9, block_size=16, max_num_batched_tokens=16)
    engine = llm.engine
    long_decode = [(7 * i) % 40000 + 100 for i in range(70)]
    scored = [(13 * i) % 40000 + 200 for i in range(100)]
    engine.add_request("decode", long_decode, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(5):
        engine.step()
    engine.add_request("scored", scored, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["scored"].metrics.num_preemptions > 0
    assert_matches(done["scored"], hf_prompt_logprobs(hf, scored), top=2)
