"""Sampler and SamplingParams: filters, penalties, seeds, logprobs, validation."""

from __future__ import annotations

import pytest
import torch

from plinth.runtime.sampler import ARGMAX_CHUNK, Sampler, SampleRow, apply_penalties, argmax_rows, filtered_probs
from plinth.sampling_params import SamplingParams
from plinth.validation import InvalidParameter


def _row(i: int, params: SamplingParams, key: str = "r", seed: int | None = None) -> SampleRow:
    return SampleRow(i, params, key, seed, [], [])


def test_greedy_is_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    rows = [_row(i, SamplingParams(temperature=0)) for i in range(4)]
    out = Sampler().sample(logits, rows)
    assert [r.token_id for r in out] == logits.argmax(-1).tolist()


@pytest.mark.parametrize("width", [4 * ARGMAX_CHUNK, 49152, 49153, 5000, 100])
def test_argmax_rows_matches_torch_argmax(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    x = torch.randn(7, width, generator=g)
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    ties = torch.randint(0, 3, (7, width), generator=g).float()  # many maxima: the first one wins
    assert torch.equal(argmax_rows(ties), ties.argmax(-1))
    ties[:3, -1] = 5.0  # the maximum in the short last slice (or the last full one)
    if width > ARGMAX_CHUNK:
        ties[3, ARGMAX_CHUNK - 1] = ties[3, ARGMAX_CHUNK] = 5.0  # across a slice boundary
    ties[4, width // 2] = float("nan")  # a NaN counts as the maximum, as in torch
    assert torch.equal(argmax_rows(ties), ties.argmax(-1))
    minus_inf = torch.full((2, width), float("-inf"))
    assert torch.equal(argmax_rows(minus_inf), minus_inf.argmax(-1))


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0)):
        probs = filtered_probs(logits, [params] * 3)
        assert torch.equal(probs.argmax(-1), logits.argmax(-1))
        assert torch.allclose(probs.max(-1).values, torch.ones(3))


def test_top_k_keeps_exactly_k() -> None:
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(2))
    probs = filtered_probs(logits, [SamplingParams(top_k=7)] * 2)
    assert ((probs > 0).sum(-1) == 7).all()
    kept = probs[0] > 0
    assert set(kept.nonzero().flatten().tolist()) == set(logits[0].topk(7).indices.tolist())


def test_top_p_keeps_smallest_prefix_reaching_mass() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, [SamplingParams(top_p=0.8)])
    assert (probs[0] > 0).tolist() == [True, True, False, False]
    probs = filtered_probs(logits, [SamplingParams(top_p=0.81)])
    assert (probs[0] > 0).tolist() == [True, True, True, False]


def test_min_p_relative_to_top() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = filtered_probs(logits, [SamplingParams(min_p=0.2)])  # keep p >= 0.1
    assert (probs[0] > 0).tolist() == [True, True, True, False]


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(4000, 3).contiguous()
    rows = [_row(i, SamplingParams(), key=f"k{i}") for i in range(4000)]
    torch.manual_seed(0)
    tokens = torch.tensor([r.token_id for r in Sampler().sample(logits, rows)])
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=42)
    alone = [Sampler().sample(logits, [_row(0, params, "a", 42)])[0].token_id for _ in range(1)]
    other = torch.randn(5, 1000)
    batch = torch.cat([other, logits])
    rows = [_row(i, SamplingParams(), f"x{i}") for i in range(5)] + [_row(5, params, "a", 42)]
    in_batch = Sampler().sample(batch, rows)[5].token_id
    assert alone[0] == in_batch
    # the generator persists across steps: a second draw continues the stream
    s = Sampler()
    draws = [s.sample(logits, [_row(0, params, "a", 42)])[0].token_id for _ in range(20)]
    assert len(set(draws)) > 1


def test_repetition_penalty_matches_hf_rule() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0])
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [0], [1])
    assert out.tolist() == [1.0, -4.0, 1.0, -1.0]


def test_presence_and_frequency_penalties_count_output_only() -> None:
    logits = torch.zeros(4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, params, prompt_ids=[3, 3], output_ids=[1, 1, 2])
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0]


def test_logprobs_are_raw_log_softmax_with_top_n() -> None:
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5)
    [res] = Sampler().sample(logits, [SampleRow(0, params, "a", None, [0, 1], [])])
    ref = torch.log_softmax(logits[0], -1)
    assert res.logprob == pytest.approx(float(ref[res.token_id]), abs=1e-6)
    assert res.top_logprobs is not None and [t for t, _ in res.top_logprobs] == ref.topk(3).indices.tolist()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": 99}, "logprobs"),
        ({"min_p": 2}, "min_p"),
        ({"stop": [""]}, "stop"),
        ({"temprature": 0.5}, "temprature"),
        ({"max_tokens": "many"}, "max_tokens"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises((InvalidParameter, TypeError)) as err:  # TypeError: an unknown keyword
        SamplingParams(**kwargs)
    assert field in str(err.value)
    if isinstance(err.value, InvalidParameter):
        assert err.value.field == field
