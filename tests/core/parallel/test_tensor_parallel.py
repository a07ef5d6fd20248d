"""Tensor and pipeline parallelism end to end on the CPU (gloo on 127.0.0.1): TP=N and PP=2 give the
single process's greedy tokens and log-probabilities; a model that does not split, a dead worker and
a hung one fail fast and by name."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from plinth import LLM, SamplingParams
from plinth.parallel.executor import WorkerFailure
from plinth.parallel.layout import ParallelLayout
from plinth.parallel.pipeline import PipelineError, stage_layers
from plinth.runtime.engine import InvalidRequest
from plinth.runtime.pipeline import PipelineRunner, micro_batches
from plinth_conformance.tiny_models import assert_same_generations, prompts, save_tiny_model

ENGINE: dict[str, Any] = dict(
    num_kv_blocks=64, block_size=16, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8, backend="cpu"
)
#: fp32 on both sides; only the order of the sums differs (partial products all-reduced)
LOGPROB_TOL = 1e-4
#: a q4_1 checkpoint on the cpu backend: activations are rounded to int8 per block on each rank
QUANT_LOGPROB_TOL = 2e-2


def _compare(got: list[Any], want: list[Any], tol: float) -> float:
    """Greedy ids equal, every top log-probability within ``tol``; returns the worst difference."""
    return assert_same_generations(got, want, tol)


def _workload(llm: LLM) -> list[Any]:
    batch = prompts(0, (1, 9, 17, 40, 70, 33))
    batch.append(batch[4][:48] + batch[1])  # a prefix-cache hit of three full blocks
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    forks = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=6, ignore_eos=True, logprobs=2)
    return llm.generate(batch, greedy) + llm.generate(batch[2:4], forks)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,tp", [("llama", 2), ("qwen2", 2), ("llama", 4)], ids=["llama-tp2", "qwen2-tp2", "llama-tp4-kv-replicated"]
)
def test_tensor_parallel_gives_the_single_process_tokens(model: str, tp: int, tmp_path: Path) -> None:
    folder = save_tiny_model(model, tmp_path / model)  # 4 heads, 2 KV heads: TP=4 replicates each twice
    want = _workload(LLM(model=str(folder), **ENGINE))
    llm = LLM(model=str(folder), tensor_parallel_size=tp, **ENGINE)
    try:
        assert llm.engine.executor is not None and len(llm.engine.executor.workers) == tp - 1
        assert llm.engine.kernels is not None and llm.engine.model.config.num_heads == 4 // tp
        _compare(_workload(llm), want, LOGPROB_TOL)
        assert llm.engine.scheduler.prefix_cache_hit_tokens >= 48
    finally:
        llm.engine.close()
    assert all(p.poll() is not None for p in llm.engine.executor.workers)  # closed: no worker left


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "qwen2", "mistral-sw"])
def test_pipeline_parallel_gives_the_single_process_tokens(model: str, tmp_path: Path) -> None:
    folder = save_tiny_model(model, tmp_path / model)  # 2 layers: one per stage
    want = _workload(LLM(model=str(folder), **ENGINE))
    llm = LLM(model=str(folder), pipeline_parallel_size=2, **ENGINE)
    try:
        runner = llm.engine.runner
        assert isinstance(runner, PipelineRunner) and runner.num_micro_batches == 2
        assert runner.stage.layers == range(0, 1) and len(llm.engine.model.layers) == 1
        assert llm.engine.model.embed_tokens is not None  # stage 0 embeds; the head is stage 1's
        _compare(_workload(llm), want, LOGPROB_TOL)
    finally:
        llm.engine.close()


def test_micro_batches_are_contiguous_near_equal_and_never_empty() -> None:
    chunks = list(range(7))
    assert micro_batches(chunks, 2) == [[0, 1, 2, 3], [4, 5, 6]]  # type: ignore[arg-type]
    assert micro_batches(chunks[:1], 4) == [[0]]  # type: ignore[arg-type]
    assert [len(g) for g in micro_batches(chunks, 3)] == [3, 2, 2]  # type: ignore[arg-type]
    assert [stage_layers(30, 4, s) for s in range(4)] == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    with pytest.raises(PipelineError, match="cannot split 2 layers into 3 pipeline stages"):
        stage_layers(2, 3, 0)


@pytest.mark.slow
def test_a_quantized_gguf_splits_on_block_boundaries_and_keeps_its_blocks(caplog: pytest.LogCaptureFixture) -> None:
    """The real SmolLM2-135M Q4_1 over 3 ranks (9 heads, 3 KV heads; o_proj's 576 inputs split into 192 =
    6 blocks of 32 each): no weight is dequantized for the split, and the tokens are TP=1's."""
    engine: dict[str, Any] = dict(num_kv_blocks=64, max_model_len=256, max_num_seqs=4, backend="cpu")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    texts = ["The capital of France is", "def fibonacci(n):"]
    want = LLM(**engine).generate(texts, params)
    with caplog.at_level(logging.WARNING, logger="plinth.parallel.sharding"):
        llm = LLM(tensor_parallel_size=3, **engine)
    try:
        assert "dequantized" not in caplog.text
        kept = ("q4_1", "q4_1p16")  # the blocks' values kept (the cpu backend lays q4_1 rows out in 16-row panels)
        assert llm.engine.model.layers[0].self_attn.o_proj.weight.format in kept
        _compare(llm.generate(texts, params), want, QUANT_LOGPROB_TOL)
    finally:
        llm.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "sizes,message",
    [
        ({"tensor_parallel_size": 3}, "num_attention_heads 4 is not divisible by 3"),
        ({"pipeline_parallel_size": 3}, "cannot split 2 layers into 3 pipeline stages"),
    ],
)
def test_a_model_that_does_not_split_is_refused_naming_the_field(
    sizes: dict[str, int], message: str, tmp_path: Path
) -> None:
    folder = save_tiny_model("llama", tmp_path / "llama")
    t0 = time.monotonic()
    with pytest.raises(InvalidRequest, match=message):
        LLM(model=str(folder), **sizes, **ENGINE)
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_tensor_and_pipeline_parallel_together_give_the_single_process_tokens(model: str, tmp_path: Path) -> None:
    """TP=2 x PP=2: four ranks, each stage's layer split over two; the logits come back from the last
    stage's tensor-parallel rank 0 only."""
    folder = save_tiny_model(model, tmp_path / model)
    want = _workload(LLM(model=str(folder), **ENGINE))
    llm = LLM(model=str(folder), tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE)
    try:
        runner = llm.engine.runner
        assert llm.engine.executor is not None and len(llm.engine.executor.workers) == 3
        assert isinstance(runner, PipelineRunner) and runner.stage.layers == range(0, 1)
        assert runner.stage.comm.world_size == 2 and runner.stage.tp_rank == 0  # the pipeline group: ranks 0, 2
        model_shard = llm.engine.model
        assert model_shard.config.num_heads == 2 and len(model_shard.layers) == 1
        assert model_shard.kernels.tp.comm.world_size == 2  # the tensor-parallel group: ranks 0, 1
        _compare(_workload(llm), want, LOGPROB_TOL)
    finally:
        llm.engine.close()
    assert all(p.poll() is not None for p in llm.engine.executor.workers)


def test_the_grid_puts_a_stages_tensor_parallel_ranks_side_by_side() -> None:
    grid = [ParallelLayout(2, 3, r) for r in range(6)]
    assert [(g.stage, g.tp_rank) for g in grid] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert grid[3].tp_groups() == [[0, 1], [2, 3], [4, 5]]
    assert grid[3].pp_groups() == [[0, 2, 4], [1, 3, 5]]
    with pytest.raises(ValueError, match="rank 6 is outside a world of 6"):
        ParallelLayout(2, 3, 6)


def _started(folder: Path, **kwargs: Any) -> LLM:
    if "pipeline_parallel_size" not in kwargs:
        kwargs.setdefault("tensor_parallel_size", 2)
    llm = LLM(model=str(folder), **ENGINE, **kwargs)
    llm.generate([prompts(1, (5,))[0]], SamplingParams(temperature=0, max_tokens=2))  # one round trip
    return llm


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_a_worker_that_dies_fails_the_engine_at_once_naming_its_rank(sizes: dict[str, int], tmp_path: Path) -> None:
    folder = save_tiny_model("llama", tmp_path / "llama")
    llm = _started(folder, **sizes)
    try:
        executor = llm.engine.executor
        assert executor is not None
        executor.workers[0].kill()
        executor.workers[0].wait(10)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"rank 1: exited with code -9"):
            llm.generate(prompts(2, (9, 9)), SamplingParams(temperature=0, max_tokens=8))
        assert time.monotonic() - t0 < 10  # a closed socket fails the collective at once
        with pytest.raises(WorkerFailure):  # and the engine stays failed: no step runs half a model
            llm.generate(prompts(3, (4,)), SamplingParams(temperature=0, max_tokens=2))
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_a_hung_worker_fails_the_engine_at_the_timeout(tmp_path: Path) -> None:
    folder = save_tiny_model("llama", tmp_path / "llama")
    llm = _started(folder, distributed_timeout_s=4.0)
    executor = llm.engine.executor
    assert executor is not None
    pid = executor.workers[0].pid
    try:
        os.kill(pid, signal.SIGSTOP)  # alive, holding its sockets, answering nothing
        t0 = time.monotonic()
        with pytest.raises(WorkerFailure, match="rank 0 of 2 failed|timed out|Timed out"):
            llm.generate(prompts(2, (9,)), SamplingParams(temperature=0, max_tokens=8))
        elapsed = time.monotonic() - t0
        assert 3.0 < elapsed < 30, elapsed
    finally:
        os.kill(pid, signal.SIGKILL)
        llm.engine.close()
