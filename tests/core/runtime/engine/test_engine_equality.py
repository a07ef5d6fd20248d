"""Greedy tokens equal Hugging Face transformers (fp32), on every backend and batching shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import hf_greedy
from engine_helpers import KINDS, save_tiny_folder

from plinth import LLM, SamplingParams

NEW_TOKENS = 32
BACKENDS = ["reference", "cpu"]
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "A",
    "In 1905, Albert Einstein published four papers that changed physics. The first explained",
    "1, 1, 2, 3, 5, 8, 13,",
    "Paris is the capital of France, and Berlin is the capital of",
    "Once upon a time, in a land far away, there lived a dragon who",
    "SELECT name, age FROM users WHERE",
]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=KINDS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp(request.param)
    return folder, save_tiny_folder(request.param, folder)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_models_match_transformers(tiny: tuple[Path, Any], backend: str) -> None:
    folder, hf = tiny
    llm = LLM(model=str(folder), backend=backend, num_kv_blocks=256, block_size=16)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batching_chunking_and_prefix_hits_do_not_change_tokens(tiny: tuple[Path, Any], backend: str) -> None:
    folder, _ = tiny
    alone_llm = LLM(model=str(folder), backend=backend, num_kv_blocks=512, block_size=16)
    alone = [alone_llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]

    batched = alone_llm.generate(PROMPTS, GREEDY)  # 8 mixed lengths in one continuous batch
    assert [o.outputs[0].token_ids for o in batched] == alone

    # the same prompts again: their full blocks are prefix-cache hits now
    again = alone_llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == alone
    assert any(o.metrics.num_cached_prompt_tokens > 0 for o in again)

    chunked = LLM(model=str(folder), backend=backend, num_kv_blocks=512, block_size=16, max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in chunked.generate(PROMPTS, GREEDY)] == alone

    # a tiny cache: requests get preempted and recomputed
    tight = LLM(model=str(folder), backend=backend, num_kv_blocks=12, block_size=8, max_model_len=80)
    outs = tight.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert tight.engine.scheduler.num_preemptions_total > 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_default_model_matches_transformers(hf_smollm2: Any, backend: str) -> None:
    """Dequantized to fp32 (transformers dequantizes the GGUF the same way), greedy tokens are equal."""
    llm = LLM(backend=backend, max_model_len=1024, quantization="none")
    prompts = [
        llm.tokenizer.encode(
            llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
            add_special_tokens=False,
        ),
        llm.tokenizer.encode("The three primary colors are"),
    ]
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_smollm2, prompt, NEW_TOKENS)
    assert "Paris" in outs[0].outputs[0].text


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["int16", "fp32", "int8"])
def test_default_model_native_q4_1(activations: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cpu backend keeps the GGUF's q4_1/q8_0 weights in their blocks (q4_1 under int16
    activations laid out in 4-row groups at load: the same values).

    With fp32 activations it computes the dequantized model's logits up to fp32 rounding; with
    int16 activations (the default) log-probabilities stay within 5e-3 nats of that (measured
    1.5e-3; int8's rounding is 256x coarser). With
    ``PLINTH_CPU_ACTIVATIONS=int8`` (llama.cpp's scheme) the logits move by the activation
    rounding: top candidates stay, log-probabilities within 0.5 nats (measured 0.05-0.32), and
    greedy text follows fp32 until two candidates are closer than that.
    """
    monkeypatch.setenv("PLINTH_CPU_ACTIVATIONS", activations)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3)
    prompt = "The three primary colors are"
    native = LLM(backend="cpu", max_model_len=256)
    paneled = activations == "int16"  # p16: int16 activations take 16-row panels on the native builds
    kept = ("q8_0", "q8_0p16") if paneled else ("q8_0",)
    assert native.engine.model.lm_head.weight.format in kept  # tied Q8_0 embedding, its blocks kept
    kept = ("q4_1", "q4_1p16") if paneled else ("q4_1",)
    assert native.engine.model.layers[0].mlp.down_proj.weight.format in kept
    fp32 = LLM(backend="cpu", max_model_len=256, quantization="none")
    assert fp32.engine.model.lm_head.weight.format in ("dense", "f32_panels")  # dequantized at load
    got, ref = (llm.generate([prompt], params)[0].outputs[0] for llm in (native, fp32))
    assert got.token_ids == ref.token_ids
    assert got.logprobs is not None and ref.logprobs is not None
    for a, b in zip(got.logprobs, ref.logprobs, strict=True):
        mine, theirs = dict(a.top), dict(b.top)
        shared = mine.keys() & theirs.keys()
        worst = max(abs(mine[t] - theirs[t]) for t in shared)
        if activations == "fp32":
            assert list(mine) == list(theirs) and worst < 1e-3
        elif activations == "int16":  # measured 1.5e-3: an outlier in a block coarsens its rounding
            assert list(mine) == list(theirs) and worst < 5e-3
        else:
            assert len(shared) >= 2 and worst < 0.5  # runners-up may swap places, not vanish
