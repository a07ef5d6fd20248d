"""The metal backend end to end in emulation: tiny Llama, Qwen2 and sliding-window Mistral models give
the reference backend's greedy tokens and log-probabilities through the whole engine (chunked
prefills, decodes and mixed steps, forks sharing blocks)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from plinth_metal.backend import EMULATE_ENV

from plinth import LLM, SamplingParams
from plinth_conformance.tiny_models import assert_same_generations, prompts, save_tiny_model

ENGINE: dict[str, Any] = dict(
    num_kv_blocks=64, block_size=16, max_model_len=256, max_num_batched_tokens=48, max_num_seqs=8
)
LOGPROB_TOL = 1e-4  # float32 on both sides


@pytest.fixture(scope="module")
def emulated() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(EMULATE_ENV, "1")
        yield


def _compare(got: list[Any], want: list[Any]) -> float:
    """Greedy ids equal; every step's top log-probabilities within LOGPROB_TOL. Returns the worst."""
    return assert_same_generations(got, want, LOGPROB_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "qwen2", "mistral-sw"])
def test_greedy_tokens_equal_the_reference(model: str, tmp_path: Path, emulated: None) -> None:
    folder = save_tiny_model(model, tmp_path / model)
    metal = LLM(model=str(folder), backend="metal", **ENGINE)
    assert metal.engine.backend.name == "metal"
    ref = LLM(model=str(folder), backend="reference", **ENGINE)
    # lengths past one block, past the 48-token step budget (chunked), and a 1-token prompt
    batch = prompts(0, (1, 9, 17, 40, 70, 33))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    _compare(metal.generate(batch, greedy), ref.generate(batch, greedy))
    forks = SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=6, ignore_eos=True, logprobs=2)
    _compare(metal.generate(batch[2:4], forks), ref.generate(batch[2:4], forks))
