"""The gaudi backend end to end in emulation: every step padded to a bucket of its phase (prefill or
decode, never mixed), the reference backend's greedy tokens and log-probabilities, and no new step
shape after warm-up over a 64-request mixed workload."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from plinth_gaudi.backend import CONTIGUOUS_ENV, EMULATE_ENV

from plinth import LLM, SamplingParams
from plinth_conformance.tiny_models import assert_same_generations, prompts, save_tiny_model

ENGINE: dict[str, Any] = dict(max_model_len=512, max_num_batched_tokens=256, max_num_seqs=64, num_kv_blocks=96)
LOGPROB_TOL = 1e-4  # float32 on both sides


@pytest.fixture()
def emulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(EMULATE_ENV, "1")
    yield


def _compare(got: list[Any], want: list[Any]) -> float:
    """Greedy ids equal; every step's top log-probabilities within LOGPROB_TOL. Returns the worst."""
    return assert_same_generations(got, want, LOGPROB_TOL)


class PhaseLog:
    """Records each step's phase and chunks, checking the backend's promise: never a step with both
    decode work (a running request's one generated token) and prefill work."""

    def __init__(self, llm: LLM) -> None:
        self.scheduler = llm.engine.scheduler
        self.phases: list[str] = []
        self._schedule = self.scheduler.schedule
        self.scheduler.schedule = self._spy  # type: ignore[method-assign]

    def _spy(self) -> Any:
        out = self._schedule()
        if not out.scheduled:
            return out
        decode_work = []
        for chunk in out.scheduled:
            request = self.scheduler.get_request(chunk.seq_id)
            assert request is not None
            decode_work.append(len(chunk.token_ids) == 1 and chunk.start_position >= len(request.prompt_token_ids))
        phase = self.scheduler.last_phase
        assert phase in ("decode", "prefill")
        if phase == "decode":
            assert all(decode_work), "a decode step holds prefill work"
        else:
            assert not any(decode_work), "a prefill step holds a decode"
        self.phases.append(phase)
        return out


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "qwen2", "mistral-sw"])
def test_greedy_tokens_equal_the_reference(model: str, tmp_path: Path, emulated: None) -> None:
    folder = save_tiny_model(model, tmp_path / model)
    gaudi = LLM(model=str(folder), backend="gaudi", **ENGINE)
    assert gaudi.engine.backend.name == "gaudi" and gaudi.engine.block_size == 128
    log = PhaseLog(gaudi)
    ref = LLM(model=str(folder), backend="reference", **ENGINE)
    # one block, several blocks, past the step budget (chunked), a 1-token prompt, a shared prefix
    batch = prompts(0, (1, 9, 130, 300, 40, 257))
    batch.append(batch[3][:200] + batch[1])  # a prefix-cache hit of one full block
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    _compare(gaudi.generate(batch, greedy), ref.generate(batch, greedy))
    forks = SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=6, ignore_eos=True, logprobs=2)
    _compare(gaudi.generate(batch[2:4], forks), ref.generate(batch[2:4], forks))
    assert gaudi.engine.scheduler.prefix_cache_hit_tokens >= 128
    assert {"decode", "prefill"} <= set(log.phases)
    assert gaudi.engine.static is not None and gaudi.engine.static.compilations_after_warmup == 0


@pytest.mark.slow
@pytest.mark.parametrize("contiguous", [False, True], ids=["any-placement", "contiguous-placement"])
def test_a_64_request_mixed_workload_meets_no_new_shape_after_warmup(
    contiguous: bool, tmp_path: Path, emulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if contiguous:
        monkeypatch.setenv(CONTIGUOUS_ENV, "1")
    folder = save_tiny_model("llama", tmp_path / "llama")
    gaudi = LLM(model=str(folder), backend="gaudi", **ENGINE)
    static = gaudi.engine.static
    assert static is not None and static.compiled is not None
    assert static.compilations == len(static.buckets.shapes())  # warm-up captured every shape
    log = PhaseLog(gaudi)
    rng = random.Random(0)
    batch = prompts(1, tuple(rng.randint(1, 300) for _ in range(64)))
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 24), ignore_eos=True) for _ in batch]
    got = gaudi.generate(batch, params)
    assert static.compilations_after_warmup == 0
    assert static.shapes_seen <= set(static.buckets.shapes())
    assert any(s.decode for s in static.shapes_seen) and any(not s.decode for s in static.shapes_seen)
    assert {"decode", "prefill"} <= set(log.phases) and gaudi.engine.scheduler.num_preemptions_total == 0
    ref = LLM(model=str(folder), backend="reference", **ENGINE)
    want = ref.generate(batch, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
