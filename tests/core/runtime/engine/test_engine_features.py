"""Engine features on a tiny model: stops, n > 1, seeds, logprobs, metrics, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_helpers import save_tiny_folder

from plinth import LLM, SamplingParams
from plinth.platform.host import BackendError
from plinth.runtime.engine import InvalidRequest
from plinth.validation import InvalidParameter


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_folder("llama", path)
    return path


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    return LLM(model=str(folder), backend="cpu", num_kv_blocks=256, block_size=16)


def _greedy(n: int = 24, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_max_tokens_and_length_finish(llm: LLM) -> None:
    [out] = llm.generate("hello world", _greedy(5))
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"
    assert out.finished and out.metrics.time_to_first_token is not None
    assert out.metrics.num_prompt_tokens == len(llm.tokenizer.encode("hello world"))


def test_stop_token_ids_and_stop_strings(llm: LLM) -> None:
    base = llm.generate("hello world", _greedy(24))[0].outputs[0]
    stop_id = base.token_ids[5]
    first = base.token_ids.index(stop_id)
    out = llm.generate("hello world", _greedy(24, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id

    stop_text = llm.tokenizer.decode(base.token_ids[8:10]).strip()
    assert stop_text, "the tiny model generated only whitespace"
    out = llm.generate("hello world", _greedy(24, stop=[stop_text]))[0].outputs[0]
    assert stop_text not in out.text and base.text.startswith(out.text)
    assert out.finish_reason == "stop" and out.stop_reason == stop_text
    kept = llm.generate("hello world", _greedy(24, stop=[stop_text], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text.endswith(stop_text)


def test_eos_stops_unless_ignored(llm: LLM) -> None:
    base = llm.generate("hello world", _greedy(12))[0].outputs[0]
    llm.engine.tokenizer.eos_token_ids.append(base.token_ids[3])
    try:
        out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
        assert out.finish_reason == "stop" and len(out.token_ids) <= 4
        out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=12, min_tokens=8))[0].outputs[0]
        assert len(out.token_ids) >= 8
    finally:
        llm.engine.tokenizer.eos_token_ids.pop()


def test_n_completions_share_the_prompt_and_seeds_reproduce(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=50.0, seed=7, max_tokens=16, ignore_eos=True)
    [a] = llm.generate("the weather today", params)
    [b] = llm.generate(["unrelated prompt first", "the weather today"], params)[1:]
    assert [c.index for c in a.outputs] == [0, 1, 2, 3]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    assert all(len(c.token_ids) == 16 for c in a.outputs)
    # the n = 1 request with seed s + k draws what completion k of the n-request drew
    [single] = llm.generate(
        "the weather today", SamplingParams(temperature=50.0, seed=9, max_tokens=16, ignore_eos=True)
    )
    assert single.outputs[0].token_ids == a.outputs[2].token_ids


def test_greedy_n_gives_identical_completions(llm: LLM) -> None:
    [out] = llm.generate("hello", SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True))
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1


def test_logprobs(llm: LLM) -> None:
    [out] = llm.generate("hello world", _greedy(6, logprobs=3))
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == 6
    for tok, lp in zip(out.outputs[0].token_ids, lps, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0
        assert lp.top[0][0] == tok  # greedy: the chosen token is the most likely one
        assert len(lp.top) == 3 and lp.top[0][1] == pytest.approx(lp.logprob)


def test_logprobs_up_to_twenty(llm: LLM) -> None:
    """The most a request may ask for (OpenAI's ``top_logprobs`` cap): 20 alternatives per generated
    token, sorted and distinct, the chosen token's among them; 21 is refused naming the field."""
    [out] = llm.generate("hello world", _greedy(4, logprobs=20))
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == 4
    for tok, lp in zip(out.outputs[0].token_ids, lps, strict=True):
        values = [v for _, v in lp.top]
        assert len(lp.top) == 20 and len({t for t, _ in lp.top}) == 20
        assert values == sorted(values, reverse=True) and lp.top[0] == (tok, pytest.approx(lp.logprob))
    with pytest.raises(InvalidParameter, match="logprobs"):
        _greedy(4, logprobs=21)


def test_chat_uses_the_template(llm: LLM) -> None:
    [out] = llm.chat([{"role": "user", "content": "Hi"}], _greedy(4))
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)


def test_bad_prompts_are_refused_and_the_engine_keeps_serving(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("good", "a fine prompt", _greedy(8))
    with pytest.raises(InvalidRequest, match=r"prompt has \d+ tokens; the context length is 512"):
        engine.add_request("long", list(range(100, 700)), _greedy(8))
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request("empty", [], _greedy(8))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.add_request("oov", [5, 10**7], _greedy(8))
    biased = SamplingParams(temperature=0, max_tokens=8, logit_bias={5: 1.0, 10**7: 2.0})
    with pytest.raises(InvalidRequest, match=r"logit_bias token ids \[10000000\] are outside the vocabulary"):
        engine.add_request("oov-bias", [5, 6], biased)
    with pytest.raises(InvalidRequest, match="already in use"):
        engine.add_request("good", "again", _greedy(8))
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert len(finished[0].outputs[0].token_ids) == 8
    assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.num_blocks - 1


def test_abort_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("a", "some prompt to abort", _greedy(50))
    engine.step()
    engine.abort_request("a")
    assert not engine.has_unfinished()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == engine.num_blocks - 1


def test_bad_engine_options(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no/such/model"):
        LLM(model="no/such/model")
    with pytest.raises(BackendError, match="unknown backend 'warp-drive'"):
        LLM(model=str(folder), backend="warp-drive")
    with pytest.raises(InvalidParameter, match="max_num_seqs"):
        LLM(model=str(folder), max_num_seqs=0)
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(model=str(folder), no_such_option=1)
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    for f in ("model.safetensors", "tokenizer.json"):
        (bad / f).write_bytes((folder / f).read_bytes())
    with pytest.raises(ValueError, match="MambaForCausalLM.*LlamaForCausalLM"):
        LLM(model=str(bad))


def test_sampling_param_errors_name_the_field(llm: LLM) -> None:
    with pytest.raises(InvalidParameter, match="top_p"):
        llm.generate("x", SamplingParams(top_p=2.0))


def test_refused_n_and_huge_seeds_leave_the_engine_clean(folder: Path) -> None:
    llm = LLM(model=str(folder), backend="cpu", num_kv_blocks=64, block_size=16, max_num_seqs=4)
    engine = llm.engine
    with pytest.raises(InvalidRequest, match="exceeds max_num_seqs"):
        engine.add_request("too-many", "hi", SamplingParams(n=5))
    assert not engine.has_unfinished()
    [out] = llm.generate("hi", SamplingParams(temperature=1.0, seed=2**64 - 1, n=2, max_tokens=3, ignore_eos=True))
    assert all(len(c.token_ids) == 3 for c in out.outputs)
    with pytest.raises(InvalidParameter, match="seed"):
        SamplingParams(seed=2**64)


def test_the_earliest_stop_string_wins(llm: LLM) -> None:
    base = llm.generate("hello world", _greedy(24))[0].outputs[0]
    early, late = base.text[1:4], base.text[5:8]
    assert early.strip() and late.strip() and base.text.find(early) < base.text.find(late)
    out = llm.generate("hello world", _greedy(24, stop=[late, early]))[0].outputs[0]
    assert out.stop_reason == early and out.text == base.text[: base.text.find(early)]


def test_kv_cache_prefault(folder: Path) -> None:
    """Prefaulted caches are written (zeros) at start-up and serve like lazy ones; the steady-state
    commands prefault by default, generate does not."""
    import argparse

    from plinth.bench.throughput import add_bench_throughput_arguments
    from plinth.config import EngineConfig
    from plinth.engine_args import add_engine_arguments, engine_options
    from plinth.server.launch import add_serve_arguments

    llm = LLM(model=str(folder), backend="cpu", num_kv_blocks=32, block_size=16, kv_cache_prefault=True)
    assert llm.engine.config.kv_cache_prefault
    assert all(not bool(kv.any()) for kv in llm.engine.runner.kv_caches)
    lazy = LLM(model=str(folder), backend="cpu", num_kv_blocks=32, block_size=16)
    params = _greedy(6)
    assert [o.outputs[0].token_ids for o in llm.generate(["hello", "world"], params)] == [
        o.outputs[0].token_ids for o in lazy.generate(["hello", "world"], params)
    ]
    for add, default in (
        (add_bench_throughput_arguments, True),
        (add_serve_arguments, True),
        (add_engine_arguments, False),
    ):
        parser = argparse.ArgumentParser()
        add(parser)
        assert EngineConfig(**engine_options(parser.parse_args([]))).kv_cache_prefault is default
        if default:
            off = parser.parse_args(["--no-kv-cache-prefault"])
            assert EngineConfig(**engine_options(off)).kv_cache_prefault is False


def test_kv_cache_dtype_option(folder: Path) -> None:
    """``--kv-cache-dtype`` reaches EngineConfig (absent: the compute dtype) and the caches' dtype."""
    import argparse

    import torch

    from plinth.config import EngineConfig
    from plinth.engine_args import add_engine_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert EngineConfig(**engine_options(parser.parse_args([]))).kv_cache_dtype is None
    options = engine_options(parser.parse_args(["--kv-cache-dtype", "bfloat16"]))
    assert EngineConfig(**options).kv_cache_dtype == "bfloat16"
    llm = LLM(model=str(folder), backend="cpu", num_kv_blocks=32, block_size=16, kv_cache_dtype="bfloat16")
    assert all(kv.dtype == torch.bfloat16 for kv in llm.engine.runner.kv_caches)
    assert len(llm.generate(["hello"], _greedy(4))[0].outputs[0].token_ids) == 4


def test_fp8_kv_cache_quarters_the_blocks_bytes(folder: Path) -> None:
    """``--kv-cache-dtype fp8`` (vLLM's name) is fp8 e4m3fn: one byte a value, so a memory budget
    holds four times the fp32 cache's blocks; the engine generates over it. A dtype the backend does
    not declare is refused by name."""
    import argparse

    import torch

    from plinth.config import EngineConfig
    from plinth.engine_args import add_engine_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for spelling in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
        options = engine_options(parser.parse_args(["--kv-cache-dtype", spelling]))
        assert EngineConfig(**options).kv_cache_dtype == "float8_e4m3fn"
        assert EngineConfig(kv_cache_dtype=spelling).kv_cache_dtype == "float8_e4m3fn"  # LLM(kv_cache_dtype=...)
    # vLLM's default spelling: the compute dtype, on the command line and in the Python API
    assert EngineConfig(**engine_options(parser.parse_args(["--kv-cache-dtype", "auto"]))).kv_cache_dtype is None
    assert EngineConfig(kv_cache_dtype="auto").kv_cache_dtype is None
    budget = dict(model=str(folder), backend="cpu", block_size=16, kv_cache_memory_gb=0.002)
    fp32 = LLM(**budget).engine.runner
    fp8 = LLM(**budget, kv_cache_dtype="float8_e4m3fn")
    assert all(kv.dtype == torch.float8_e4m3fn for kv in fp8.engine.runner.kv_caches)
    assert fp8.engine.runner.kv_caches[0].shape[1] == 4 * fp32.kv_caches[0].shape[1]  # [2, num_blocks, ...]
    assert len(fp8.generate(["hello"], _greedy(4))[0].outputs[0].token_ids) == 4
    with pytest.raises(Exception, match="float8_e5m2"):
        LLM(model=str(folder), backend="cpu", num_kv_blocks=32, kv_cache_dtype="float8_e5m2")


def test_a_finished_sequence_leaves_no_generator_behind(llm: LLM) -> None:
    """The scheduler lists finished sequences in the next step's output and the runner drops their
    seeded generators: a request id used again with the same seed draws the same tokens afresh."""
    engine = llm.engine
    params = SamplingParams(n=2, temperature=50.0, seed=3, max_tokens=4, ignore_eos=True)

    def run(request_id: str) -> list[list[int]]:
        engine.add_request(request_id, "a seeded prompt", params)
        last = []
        while engine.has_unfinished():
            last = engine.step() or last
        return [c.token_ids for c in last[-1].outputs]

    first = run("x")
    assert run("x") == first and len({tuple(t) for t in first}) == 2
    engine.add_request("later", "another prompt", _greedy(1))
    while engine.has_unfinished():
        engine.step()
    assert not engine.runner.sampler._generators
