"""Multi-LoRA serving: outputs equal transformers + PEFT with the adapter merged, mixed batches equal
each request alone, adapters never share prefix-cache blocks, step graphs stay correct, and the
engine's adapter operations refuse what they cannot do while the engine keeps serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import hf_greedy
from engine_helpers import save_tiny_folder
from lora_helpers import save_peft_adapter

from plinth import LLM, SamplingParams
from plinth.runtime.engine import InvalidRequest

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n    if n < 2:", "1, 1, 2, 3, 5, 8, 13,"]
#: plinth's fp32 logprob of each greedy token vs transformers' on the merged model (the same sums
#: in another order: a few ulps of the logits, measured ~1e-6)
LOGPROB_ATOL = 1e-4


_MADE: dict[str, dict[str, Any]] = {}


def _make(kind: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny base model and two adapters: a1 (r=8, every module), a2 (r=4, rsLoRA, attention only)."""
    if kind in _MADE:
        return _MADE[kind]
    root = tmp_path_factory.mktemp(f"lora-{kind}")
    hf = save_tiny_folder(kind, root / "base")
    merged1 = save_peft_adapter(hf, root / "a1", r=8, alpha=16, seed=1)
    merged2 = save_peft_adapter(
        hf, root / "a2", r=4, alpha=8, seed=2, use_rslora=True, targets=("q_proj", "k_proj", "v_proj", "o_proj")
    )
    made = {"base": root / "base", "a1": root / "a1", "a2": root / "a2", "hf": {None: hf, "a1": merged1, "a2": merged2}}
    _MADE[kind] = made
    return made


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The Llama base and its adapters (the equality test covers Qwen2 too)."""
    return _make("llama", tmp_path_factory)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_kind(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Llama (GQA, tied embeddings) and Qwen2 (q/k/v bias) bases and their adapters."""
    return _make(request.param, tmp_path_factory)


def _llm(tiny: dict[str, Any], backend: str, **kwargs: Any) -> LLM:
    return LLM(
        model=str(tiny["base"]),
        backend=backend,
        num_kv_blocks=256,
        block_size=16,
        lora={"a1": str(tiny["a1"]), "a2": str(tiny["a2"])},
        **kwargs,
    )


def _hf_logprobs(hf: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' logprob of each of ``tokens`` after ``prompt`` (one forward over both)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [n, V]
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_adapters_match_transformers_peft_merged(tiny_kind: dict[str, Any], backend: str) -> None:
    tiny = tiny_kind
    llm = _llm(tiny, backend)
    # the reference kernels are slow: two prompts there
    prompts = [llm.tokenizer.encode(p) for p in (PROMPTS if backend == "cpu" else PROMPTS[:2])]
    for name in (None, "a1", "a2"):
        hf = tiny["hf"][name]
        outs = llm.generate(prompts, GREEDY, lora=name)
        for prompt, out in zip(prompts, outs, strict=True):
            tokens = out.outputs[0].token_ids
            assert tokens == hf_greedy(hf, prompt, NEW_TOKENS), (name, prompt)
            ours = torch.tensor([lp.logprob for lp in out.outputs[0].logprobs or []])
            torch.testing.assert_close(ours, _hf_logprobs(hf, prompt, tokens), atol=LOGPROB_ATOL, rtol=0)
    # the adapters do change the output (else the test above proves nothing)
    p = prompts[0]
    assert hf_greedy(tiny["hf"]["a1"], p, NEW_TOKENS) != hf_greedy(tiny["hf"][None], p, NEW_TOKENS)
    assert hf_greedy(tiny["hf"]["a2"], p, NEW_TOKENS) != hf_greedy(tiny["hf"][None], p, NEW_TOKENS)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_mixed_adapter_batch_equals_each_alone(tiny: dict[str, Any], backend: str) -> None:
    llm = _llm(tiny, backend, enforce_eager=True)
    names = ["a1", None, "a2", "a2", "a1", None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    alone = [llm.generate(p, GREEDY, lora=n)[0].outputs[0].token_ids for p, n in zip(prompts, names, strict=True)]
    mixed = llm.generate(prompts, GREEDY, lora=names)  # one continuous batch: prefills, then mixed decodes
    assert [o.outputs[0].token_ids for o in mixed] == alone
    # chunked prefill: prompt chunks of different adapters side by side in one step
    chunked = _llm(tiny, backend, enforce_eager=True, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, GREEDY, lora=names)] == alone


def test_prefix_cache_is_not_shared_between_adapters(tiny: dict[str, Any]) -> None:
    llm = _llm(tiny, "cpu")
    prompt = "Once upon a time, in a land far away, there lived a dragon who liked to count: one, two, three" * 2
    assert len(llm.tokenizer.encode(prompt)) > 32  # two full blocks at least
    first = llm.generate(prompt, GREEDY, lora="a1")[0]
    assert first.metrics.num_cached_prompt_tokens == 0
    for name in ("a2", None):  # the same tokens under another adapter (or none): no hit
        assert llm.generate(prompt, GREEDY, lora=name)[0].metrics.num_cached_prompt_tokens == 0
    again = llm.generate(prompt, GREEDY, lora="a1")[0]  # the same adapter: a hit, the same tokens
    assert again.metrics.num_cached_prompt_tokens >= 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_step_graphs_stay_correct_and_lora_steps_run_eagerly(tiny: dict[str, Any]) -> None:
    eager = _llm(tiny, "cpu", enforce_eager=True)
    graphed = _llm(tiny, "cpu")
    graphs = graphed.engine.runner.graphs
    assert graphs is not None
    names = ["a1", None, "a2"]
    want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, lora=names)]
    base_only = graphed.generate(PROMPTS, GREEDY)  # captures and replays the base model's decode steps
    assert graphs.stats.replays > 0
    replays = graphs.stats.replays
    assert [o.outputs[0].token_ids for o in graphed.generate(PROMPTS, GREEDY, lora=names)] == want
    assert graphs.stats.replays == replays  # every step had adapter tokens: none replayed
    again = graphed.generate(PROMPTS, GREEDY)  # the base model's graphs still replay, unchanged
    assert graphs.stats.replays > replays
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in base_only]


def test_speculative_decoding_with_an_adapter(tiny: dict[str, Any]) -> None:
    plain = _llm(tiny, "cpu", enforce_eager=True)
    spec = _llm(tiny, "cpu", num_speculative_tokens=3)
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,"
    for name in ("a1", None):
        want = plain.generate(prompt, GREEDY, lora=name)[0].outputs[0].token_ids
        assert spec.generate(prompt, GREEDY, lora=name)[0].outputs[0].token_ids == want


def test_unloading_an_adapter_in_use_finishes_its_requests_first(tiny: dict[str, Any]) -> None:
    llm = _llm(tiny, "cpu", max_loras=2)
    want = llm.generate(PROMPTS[0], GREEDY, lora="a1")[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("r1", PROMPTS[0], GREEDY, lora="a1")
    engine.step()
    engine.step()
    engine.remove_lora("a1")  # r1 still runs with it
    assert engine.list_loras() == ["a2"]
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'a1'") as err:
        engine.add_request("r2", PROMPTS[0], GREEDY, lora="a1")
    assert err.value.param == "lora"
    with pytest.raises(InvalidRequest, match="no free LoRA slot"):  # a1's slot is still held by r1
        engine.add_lora("a3", str(tiny["a1"]))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    assert final is not None and final.outputs[0].token_ids == want
    engine.add_lora("a3", str(tiny["a1"]))  # r1 ended: the slot is free again, the same weights
    assert llm.generate(PROMPTS[0], GREEDY, lora="a3")[0].outputs[0].token_ids == want


def test_adapter_operations_refuse_with_clear_errors(tiny: dict[str, Any], tmp_path: Path) -> None:
    llm = _llm(tiny, "reference", max_loras=2, max_lora_rank=8)
    with pytest.raises(InvalidRequest, match="already loaded") as err:
        llm.add_lora("a1", str(tiny["a2"]))
    assert err.value.param == "lora_name"
    with pytest.raises(InvalidRequest, match="no free LoRA slot"):
        llm.add_lora("a3", str(tiny["a2"]))
    llm.remove_lora("a2")
    with pytest.raises(InvalidRequest, match="is not a folder") as err:
        llm.add_lora("x", str(tmp_path / "missing"))
    assert err.value.param == "lora_path"
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'nope'"):
        llm.remove_lora("nope")
    with pytest.raises(InvalidRequest, match=r"no LoRA adapter named 'nope' is loaded \(loaded: 'a1'\)"):
        llm.generate("hi", GREEDY, lora="nope")
    assert llm.generate("hi", GREEDY, lora="a1")[0].finished  # still serving
    with pytest.raises(InvalidRequest, match="r=16 exceeds max_lora_rank=8") as err:
        big = tmp_path / "big"
        save_peft_adapter(tiny["hf"][None], big, r=16)
        llm.add_lora("big", str(big))
    assert err.value.param == "lora_path (r)"
    off = LLM(model=str(tiny["base"]), backend="reference", num_kv_blocks=64, block_size=16)
    with pytest.raises(InvalidRequest, match="enable_lora=True"):
        off.generate("hi", GREEDY, lora="a1")
    with pytest.raises(InvalidRequest, match="enable_lora=True"):
        off.add_lora("a1", str(tiny["a1"]))
    with pytest.raises(TypeError, match="lora has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], GREEDY, lora=["a1"])


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4], ids=["tp2", "tp4-kv-replicated"])
def test_tensor_parallel_ranks_serve_their_slices_of_each_adapter(tiny_kind: dict[str, Any], tp: int) -> None:
    """Each rank holds its slice of every adapter (B by output rows where the base weight is split by
    rows, A by input columns where by columns, whose delta joins the all-reduce); adapters loaded
    and freed after the start reach the workers between two steps. 4 heads, 2 KV heads: TP=4 shares
    each KV head between two ranks, and the k/v adapters' rows with it."""
    tiny = tiny_kind
    llm = _llm(tiny, "cpu", tensor_parallel_size=tp)
    try:
        assert llm.engine.executor is not None and len(llm.engine.executor.workers) == tp - 1
        prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
        for name in (None, "a1", "a2"):
            hf = tiny["hf"][name]
            for prompt, out in zip(prompts, llm.generate(prompts, GREEDY, lora=name), strict=True):
                tokens = out.outputs[0].token_ids
                assert tokens == hf_greedy(hf, prompt, NEW_TOKENS), (name, prompt)
                ours = torch.tensor([lp.logprob for lp in out.outputs[0].logprobs or []])
                torch.testing.assert_close(ours, _hf_logprobs(hf, prompt, tokens), atol=LOGPROB_ATOL, rtol=0)
        llm.remove_lora("a2")  # its slot cleared on every rank
        llm.add_lora("a3", str(tiny["a1"]))  # into a2's slot, on every rank, after the start
        mixed = llm.generate(prompts, GREEDY, lora=["a3", None, "a1"])
        assert [o.outputs[0].token_ids for o in mixed] == [
            hf_greedy(tiny["hf"]["a1"], prompts[0], NEW_TOKENS),
            hf_greedy(tiny["hf"][None], prompts[1], NEW_TOKENS),
            hf_greedy(tiny["hf"]["a1"], prompts[2], NEW_TOKENS),
        ]
    finally:
        llm.engine.close()


def test_config_refuses_lora_with_pipeline_stages_and_ranks_above_64() -> None:
    from plinth.config import EngineConfig
    from plinth.validation import InvalidParameter

    assert EngineConfig(enable_lora=True, tensor_parallel_size=2).enable_lora  # split with the model
    with pytest.raises(ValueError, match="enable_lora with pipeline_parallel_size 2"):
        EngineConfig(enable_lora=True, pipeline_parallel_size=2)
    with pytest.raises(InvalidParameter, match="max_lora_rank"):
        EngineConfig(enable_lora=True, max_lora_rank=128)
    with pytest.raises(InvalidParameter, match="max_loras"):
        EngineConfig(enable_lora=True, max_loras=0)
