"""Embedding requests in the engine: pooled vectors equal a plain transformers forward, through chunked
prefill, prefix hits and continuous batching with generation (whose tokens they leave unchanged)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import save_tiny_folder

from plinth import LLM, SamplingParams
from plinth.pooling_params import PoolingParams
from plinth.runtime.engine import InvalidRequest
from plinth.validation import InvalidParameter

#: fp32 on both sides; what differs is only the order of the sums (kernels, chunked attention)
ATOL = 1e-4
BACKENDS = ["reference", "cpu"]
INPUTS = [
    "The quick brown fox jumps over the lazy dog",
    "A",
    "In 1905, Albert Einstein published four papers that changed physics. The first explained the "
    "photoelectric effect, the second Brownian motion, the third special relativity.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("llama")
    return folder, save_tiny_folder("llama", folder)


def hf_pooled(hf: Any, ids: list[int], pooling: str, normalize: bool = True) -> torch.Tensor:
    """transformers' final-norm hidden states of ``ids`` (``last_hidden_state``), pooled in fp32."""
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0].float()  # [T, hidden]
    vec = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def _llm(folder: Path, backend: str, **kwargs: Any) -> LLM:
    return LLM(model=str(folder), backend=backend, dtype="float32", num_kv_blocks=128, block_size=16, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers(tiny: tuple[Path, Any], backend: str, pooling: str) -> None:
    folder, hf = tiny
    llm = _llm(folder, backend)
    ids = [llm.tokenizer.encode(p) for p in INPUTS]
    outs = llm.embed(INPUTS, pooling=pooling)
    for prompt, out in zip(ids, outs, strict=True):
        expected = hf_pooled(hf, prompt, pooling)
        assert out.num_prompt_tokens == len(prompt)
        assert len(out.embedding) == 64
        torch.testing.assert_close(torch.tensor(out.embedding), expected, atol=ATOL, rtol=0)
        assert math.isclose(sum(v * v for v in out.embedding), 1.0, rel_tol=1e-5)
    raw = llm.embed(ids, pooling=pooling, normalize=False)  # token ids in, no normalisation
    for prompt, out in zip(ids, raw, strict=True):
        torch.testing.assert_close(
            torch.tensor(out.embedding), hf_pooled(hf, prompt, pooling, False), atol=ATOL, rtol=0
        )


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_chunked_prefill_and_prefix_hits_give_the_same_embedding(tiny: tuple[Path, Any], pooling: str) -> None:
    folder, hf = tiny
    whole = _llm(folder, "cpu").embed(INPUTS, pooling=pooling)
    chunked_llm = _llm(folder, "cpu", max_num_batched_tokens=16)  # the long input spans 3+ steps
    chunked = chunked_llm.embed(INPUTS, pooling=pooling)
    again = chunked_llm.embed(INPUTS, pooling=pooling)  # last pooling: full blocks are prefix hits now
    for a, b, c in zip(whole, chunked, again, strict=True):
        torch.testing.assert_close(torch.tensor(a.embedding), torch.tensor(b.embedding), atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(a.embedding), torch.tensor(c.embedding), atol=ATOL, rtol=0)
    engine = chunked_llm.engine
    assert not engine.has_unfinished() and engine.scheduler.kv_usage == 0.0  # every block returned
    if pooling == "last":
        assert engine.scheduler.prefix_cache_hit_tokens > 0


def test_embeddings_batch_with_generation_and_leave_its_tokens_unchanged(tiny: tuple[Path, Any]) -> None:
    folder, hf = tiny
    llm = _llm(folder, "cpu", max_num_batched_tokens=32)
    alone = llm.generate(INPUTS, GREEDY)
    engine = llm.engine
    for i, p in enumerate(INPUTS):
        engine.add_request(f"g{i}", p, GREEDY)
    finals: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished():
        if steps in (0, 3, 6):  # embeddings arrive while prompts prefill and while decodes run
            for i, p in enumerate(INPUTS):
                engine.add_embedding_request(f"e{steps}-{i}", p, PoolingParams(pooling="mean" if i else "last"))
        steps += 1
        for out in engine.step():
            assert out.request_id not in finals
            if out.finished:
                finals[out.request_id] = out
    assert [finals[f"g{i}"].outputs[0].token_ids for i in range(3)] == [o.outputs[0].token_ids for o in alone]
    ids = [llm.tokenizer.encode(p) for p in INPUTS]
    for s in (0, 3, 6):
        for i, prompt in enumerate(ids):
            out = finals[f"e{s}-{i}"]
            assert out.outputs == [] and out.embedding is not None
            assert out.metrics.num_prompt_tokens == len(prompt) and out.metrics.first_scheduled_time is not None
            expected = hf_pooled(hf, prompt, "mean" if i else "last")
            torch.testing.assert_close(torch.tensor(out.embedding), expected, atol=ATOL, rtol=0)
    assert engine.scheduler.kv_usage == 0.0


def test_a_one_token_input_rides_a_decode_step_graph(tiny: tuple[Path, Any]) -> None:
    folder, hf = tiny
    llm = _llm(folder, "cpu")
    engine = llm.engine
    engine.add_request("g", INPUTS[0], GREEDY)
    engine.step()  # the prompt; from now on steps are decodes
    engine.step()
    graphs = engine.runner.graphs
    assert graphs is not None

    def graph_steps() -> int:
        return graphs.stats.replays + graphs.stats.captures

    before = graph_steps()
    engine.add_embedding_request("e", [42], PoolingParams(pooling="mean"))
    embedded = [o for o in engine.step() if o.request_id == "e"]
    assert graph_steps() == before + 1  # the embedding's one token and the decode: one graph step
    [out] = embedded
    torch.testing.assert_close(torch.tensor(out.embedding), hf_pooled(hf, [42], "mean"), atol=ATOL, rtol=0)
    engine.abort_all()


def test_refused_inputs_name_what_is_wrong(tiny: tuple[Path, Any]) -> None:
    folder, _ = tiny
    llm = _llm(folder, "reference", max_model_len=64)
    with pytest.raises(InvalidRequest, match="empty"):
        llm.embed([[]])
    with pytest.raises(InvalidRequest, match=r"prompts\[1\]: input token ids \[999999\] are outside"):
        llm.embed([[1, 2], [999999]])
    with pytest.raises(InvalidRequest, match="65 tokens; the context length is 64"):
        llm.embed([[5] * 65])
    assert len(llm.embed([[5] * 64])[0].embedding) == 64  # an input may fill the whole context
    with pytest.raises(InvalidRequest, match="dimensions=32: this model does not support truncation"):
        llm.embed("hi", dimensions=32)
    assert len(llm.embed("hi", dimensions=64)[0].embedding) == 64  # the full size is no truncation
    with pytest.raises(InvalidParameter, match="pooling"):
        llm.embed("hi", pooling="cls")
    with pytest.raises(InvalidParameter, match="dimensions"):
        llm.embed("hi", dimensions=0)
    assert not llm.engine.has_unfinished()


def test_matryoshka_dimensions_truncate_then_normalise(tiny: tuple[Path, Any], tmp_path: Path) -> None:
    import json
    import shutil

    folder, hf = tiny
    copy = tmp_path / "matryoshka"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    llm = _llm(copy, "reference")
    ids = llm.tokenizer.encode(INPUTS[0])
    [out] = llm.embed(INPUTS[0], dimensions=16)
    expected = torch.nn.functional.normalize(hf_pooled(hf, ids, "last", normalize=False)[:16], dim=0)
    torch.testing.assert_close(torch.tensor(out.embedding), expected, atol=ATOL, rtol=0)
    with pytest.raises(InvalidRequest, match=r"dimensions=24: this model allows \[16, 32\]"):
        llm.embed("hi", dimensions=24)
