"""Sampler and SamplingParams: filters, penalties, seeds, logprobs, validation."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plinth.platform.backend import SmallOps
from plinth.runtime.sampler import Sampler, SampleResult, apply_penalties, filtered_probs
from plinth.sampling_params import SamplingParams
from plinth.sched.request import Sample, SequenceId
from plinth.validation import InvalidParameter

Row = tuple[int, Sample[SamplingParams]]  # (the logits row it reads, the sample)


def _row(
    i: int, params: SamplingParams, key: str = "r", seed: int | None = None, prompt: list[int] | None = None
) -> Row:
    return i, Sample(SequenceId(key, 0), params, seed, prompt or [], [])


def _sample(sampler: Sampler, logits: torch.Tensor, rows: list[Row]) -> list[SampleResult]:
    return sampler.sample(logits, [smp for _, smp in rows], [i for i, _ in rows])


def test_greedy_is_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    rows = [_row(i, SamplingParams(temperature=0)) for i in range(4)]
    out = _sample(Sampler(), logits, rows)
    assert [r.token_id for r in out] == logits.argmax(-1).tolist()


class _CountingOps(SmallOps):
    """The default ops, counting argmax calls: the sampler must pick its tokens through them."""

    def __init__(self) -> None:
        self.calls = 0

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().argmax(x)


def test_tokens_are_picked_by_the_backends_argmax() -> None:
    ops = _CountingOps()
    sampler = Sampler(ops)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    greedy = [_row(i, SamplingParams(temperature=0)) for i in range(3)]
    assert [r.token_id for r in _sample(sampler, logits, greedy)] == logits.argmax(-1).tolist()
    assert ops.calls == 1
    mixed = [_row(0, SamplingParams(temperature=0)), _row(1, SamplingParams(), "b", 3), _row(2, SamplingParams())]
    _sample(sampler, logits, mixed)
    assert ops.calls == 3  # the greedy rows, then the random ones' exponential race


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
    tokens = torch.tensor([r.token_id for r in _sample(Sampler(), logits, rows)])
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=42)
    alone = [_sample(Sampler(), logits, [_row(0, params, "a", 42)])[0].token_id for _ in range(1)]
    other = torch.randn(5, 1000)
    batch = torch.cat([other, logits])
    rows = [_row(i, SamplingParams(), f"x{i}") for i in range(5)] + [_row(5, params, "a", 42)]
    in_batch = _sample(Sampler(), batch, rows)[5].token_id
    assert alone[0] == in_batch
    # the generator persists across steps: a second draw continues the stream
    s = Sampler()
    draws = [_sample(s, logits, [_row(0, params, "a", 42)])[0].token_id for _ in range(20)]
    assert len(set(draws)) > 1
    # forget drops the sequence's generator: the next draw starts the stream from its seed again
    s.forget(SequenceId("a", 0))
    assert [_sample(s, logits, [_row(0, params, "a", 42)])[0].token_id for _ in range(20)] == draws


def test_the_samples_of_a_fork_share_a_logits_row_and_seed_apart() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=1.0, seed=7)
    fork = [(0, Sample(SequenceId("p", k), params, 7 + k, [], [])) for k in range(3)]
    together = [r.token_id for r in _sample(Sampler(), logits, fork)]
    apart = [_sample(Sampler(), logits, [row])[0].token_id for row in fork]
    assert together == apart and len(set(together)) > 1


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
    [res] = _sample(Sampler(), logits, [_row(0, params, "a", None, [0, 1])])
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


def test_logit_bias_moves_the_pick_of_its_row_only() -> None:
    """-100 takes the argmax out of the running, +100 forces a token; another row in the same batch
    and the logprobs (the model's own distribution) are untouched."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(11))
    top2 = logits[0].topk(2).indices.tolist()
    banned = SamplingParams(temperature=0, logit_bias={top2[0]: -100.0}, logprobs=1)
    forced = SamplingParams(temperature=0.7, seed=3, logit_bias={7: 100})
    plain = SamplingParams(temperature=0)
    before = logits.clone()
    out = _sample(Sampler(), logits, [_row(0, banned, "a"), _row(0, forced, "b"), _row(1, plain, "c")])
    assert out[0].token_id == top2[1]
    assert out[1].token_id == 7
    assert out[2].token_id == int(logits[1].argmax())
    assert torch.equal(logits, before)  # the caller's logits are never written
    raw = torch.log_softmax(before[0], -1)
    assert out[0].logprob == pytest.approx(float(raw[top2[1]]))  # the unbiased distribution's
    assert out[0].top_logprobs is not None and out[0].top_logprobs[0][0] == top2[0]


def test_logit_bias_is_checked_field_by_field() -> None:
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(logit_bias={5: 1}).logit_bias == {5: 1.0}
    for bad, words in [
        ({"5": 1.0}, "keys must be token ids"),
        ({True: 1.0}, "keys must be token ids"),
        ({-1: 1.0}, "keys must be token ids"),
        ({5: 100.5}, "the bias of token 5 must be at most 100.0"),
        ({5: float("nan")}, "the bias of token 5 must be a number"),
        ({5: float("-inf")}, "the bias of token 5 must be at least -100.0"),
        ([5], "must be a dict"),
    ]:
        with pytest.raises(InvalidParameter, match=words) as info:
            SamplingParams(logit_bias=bad)  # type: ignore[arg-type]
        assert info.value.field == "logit_bias"


# -- structured output: token bitmasks ---------------------------------------------------------------


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[S, V] bool -> the [S, ceil(V/32)] int32 bitmask (bit t % 32 of word t // 32)."""
    rows, vocab = allowed.shape
    words = -(-vocab // 32)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # bit 31 is the sign


def _masks(bitmask: torch.Tensor, rows: dict[SequenceId, int]) -> Any:
    from concurrent.futures import Future

    from plinth.structured.masks import StepMasks, StructuredOutputs

    done: Future[torch.Tensor] = Future()
    done.set_result(bitmask)
    return StepMasks(rows, done, StructuredOutputs(None, bitmask.shape[1] * 32))  # type: ignore[arg-type]


@pytest.mark.parametrize("vocab", [31, 32, 100, 1000])
def test_apply_token_bitmask_forbids_exactly_the_cleared_bits(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(5, vocab, generator=gen) < 0.3
    allowed[:, -1] = True  # the last token (bit 31 of a word: the sign bit) among the allowed
    base = torch.randn(5, vocab + 7, generator=gen)
    logits = base[:, 3 : 3 + vocab]  # a view with a row stride, as the contract allows
    SmallOps().apply_token_bitmask(logits, _pack(allowed))
    assert torch.equal(logits.isinf(), ~allowed)
    assert torch.equal(logits[allowed], base[:, 3 : 3 + vocab][allowed])


def test_masked_rows_sample_only_allowed_tokens_and_others_are_untouched() -> None:
    vocab = 70
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, vocab, generator=gen)
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[0, [5, 40, 69]] = True
    allowed[1, [0, 33]] = True
    rows = [
        _row(0, SamplingParams(temperature=0), key="greedy"),
        _row(1, SamplingParams(temperature=1.0), key="free"),
        _row(2, SamplingParams(temperature=5.0), key="random"),
    ]
    masks = _masks(_pack(allowed), {SequenceId("greedy", 0): 0, SequenceId("random", 0): 1})
    free_alone = Sampler()
    seen: set[int] = set()
    for _ in range(200):
        out = Sampler().sample(logits, [s for _, s in rows], [0, 1, 2], masks)
        assert out[0].token_id == max((5, 40, 69), key=lambda t: float(logits[0, t]))
        seen.add(out[2].token_id)
    assert seen == {0, 33}  # a hot temperature reaches both allowed tokens, never another
    # the unconstrained row draws from its whole distribution, as without masks
    unmasked = [free_alone.sample(logits, [rows[1][1]], [1])[0].token_id for _ in range(200)]
    assert len(set(unmasked)) > 10
    assert torch.equal(logits, torch.randn(3, vocab, generator=torch.Generator().manual_seed(3)))  # caller's intact
