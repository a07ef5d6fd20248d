"""Draft verification: the output distribution is the plain sampler's, seeded tokens are identical."""

from __future__ import annotations

import hashlib

import pytest
import torch

from plinth.runtime.sampler import Sampler, filtered_probs
from plinth.runtime.speculative import logit_rows, may_speculate, verify
from plinth.sampling_params import SamplingParams, StructuredOutputs
from plinth.sched.output import ScheduledChunk
from plinth.sched.request import Sample, SequenceId

V = 6  # a small vocabulary: every token's frequency is measured
TRIALS = 20_000
# chi-square critical value at p = 1e-4 for V - 1 = 5 degrees of freedom (a false alarm 1 run in 10^4)
CHI2_CRIT_5DF = 25.74


def _chunk(
    key: str, params: SamplingParams, drafts: list[int], seed: int | None = None, output: list[int] | None = None
) -> ScheduledChunk[SamplingParams]:
    sid = SequenceId(key, 0)
    sample = Sample(sid, params, seed, [1, 2, 3], list(output or []))
    return ScheduledChunk(sid, [3, *drafts], 3 + len(output or []), [1], (sample,), draft_token_ids=list(drafts))


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic over the tokens with a non-zero probability; a count where the
    probability is 0 is an outright failure."""
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, f"tokens of probability 0 were emitted: {counts}"
    keep = probs > 0
    expected = probs[keep] * n
    return float(((counts[keep] - expected) ** 2 / expected).sum())


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
]


@pytest.mark.parametrize("params", PARAMS, ids=["plain", "top_k", "top_p_min_p"])
@pytest.mark.parametrize("draft", [0, 2, 5])
def test_one_draft_preserves_the_first_and_second_token_distribution(params: SamplingParams, draft: int) -> None:
    """Many sequences with the same two-position logits, one draft each: the first emitted token
    is distributed as p0, the second (after an accepted draft) as p1; the draft is accepted with
    probability p0(draft), and a rejected one is replaced by p0 without the draft, renormalised."""
    torch.manual_seed(1234)
    l0 = torch.tensor([1.0, 0.2, 0.9, -0.5, 0.4, -1.5])
    l1 = torch.tensor([-0.3, 1.1, 0.0, 0.8, -1.0, 0.5])
    p0 = filtered_probs(l0[None], [params])[0]
    p1 = filtered_probs(l1[None], [params])[0]
    scheduled = [_chunk(f"s{i}", params, [draft]) for i in range(TRIALS)]
    logits = torch.stack([l0, l1]).repeat(TRIALS, 1)  # [2N, V]: each sequence's rows for [t, draft]
    results = verify(Sampler(), logits, scheduled, list(range(TRIALS)))

    first = torch.zeros(V)
    second = torch.zeros(V)
    rejected = torch.zeros(V)
    for c in scheduled:
        r = results[c.seq_id]
        if r.accepted:
            assert [a.token_id for a in r.accepted] == [draft]
            first[draft] += 1
            second[r.token_id] += 1
        else:
            assert r.token_id != draft
            first[r.token_id] += 1
            rejected[r.token_id] += 1
    assert _chi2(first, p0) < CHI2_CRIT_5DF
    accept_rate = first[draft] / TRIALS
    sd = (p0[draft] * (1 - p0[draft]) / TRIALS) ** 0.5
    assert abs(accept_rate - p0[draft]) <= 4 * sd + 1e-9
    if second.sum() > 0:
        assert _chi2(second, p1) < CHI2_CRIT_5DF
    residual = p0.clone()
    residual[draft] = 0
    residual /= residual.sum()
    assert _chi2(rejected, residual) < CHI2_CRIT_5DF
    assert 0.5 * float((first / TRIALS - p0).abs().sum()) < 0.02  # total variation


def test_greedy_accepts_while_the_argmax_agrees() -> None:
    greedy = SamplingParams(temperature=0)
    rows = torch.full((4, V), -1.0)
    rows[0, 2] = rows[1, 4] = rows[2, 1] = rows[3, 5] = 1.0  # argmax 2, 4, 1, 5 after each prefix
    for drafts, emitted in (([2, 4, 1], [2, 4, 1, 5]), ([2, 3, 1], [2, 4]), ([0, 4, 1], [2])):
        c = _chunk("g", greedy, drafts)
        r = verify(Sampler(), rows, [c], [0])[c.seq_id]
        assert [*(a.token_id for a in r.accepted), r.token_id] == emitted


def test_logit_rows_index_every_position_of_a_speculating_chunk() -> None:
    p = SamplingParams()
    plain = ScheduledChunk(SequenceId("a", 0), [1, 2, 3], 0, [1], ())  # a prefill chunk: no sample
    spec = _chunk("b", p, [7, 8])
    dec = _chunk("c", p, [])
    assert logit_rows([plain, spec, dec], [1, 2]) == [3, 4, 5, 6]


def _model_logits(prefix: list[int], vocab: int = 8) -> torch.Tensor:
    """A deterministic stand-in for a model: logits that depend on the whole prefix."""
    digest = hashlib.sha256(bytes(t % 256 for t in prefix)).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn(vocab, generator=g) * 2.0


SEEDED = [
    SamplingParams(temperature=0.9, seed=7),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=11, logprobs=2),
    SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, seed=3),
    SamplingParams(temperature=0, logit_bias={3: 1.5}, repetition_penalty=1.2, logprobs=0),
]


@pytest.mark.parametrize("params", SEEDED, ids=["seeded", "filters_logprobs", "penalties", "greedy_bias"])
def test_seeded_tokens_are_identical_with_and_without_drafts(params: SamplingParams) -> None:
    """The same seeded sequence decoded one token per step, and with drafts that are sometimes
    right and sometimes wrong: the same tokens and logprobs (penalties see the drafts as output)."""
    prompt = [1, 2, 3]
    steps = 40
    plain_sampler, plain, plain_lp = Sampler(), [], []
    for _ in range(steps):
        sample = Sample(SequenceId("x", 0), params, params.seed, prompt, list(plain))
        (r,) = plain_sampler.sample(_model_logits(prompt + plain)[None], [sample], [0])
        plain.append(r.token_id)
        plain_lp.append((r.logprob, r.top_logprobs))

    spec_sampler, spec, spec_lp = Sampler(), [], []
    rng = torch.Generator().manual_seed(0)
    while len(spec) < steps:
        k = int(torch.randint(0, 5, (1,), generator=rng))
        # drafts: the true continuation, each token wrong with probability 1/3
        truth = plain[len(spec) : len(spec) + k]
        drafts = [t if torch.rand(1, generator=rng) > 0.33 else (t + 1) % 8 for t in truth]
        sid = SequenceId("x", 0)
        sample = Sample(sid, params, params.seed, prompt, list(spec))
        chunk = ScheduledChunk(sid, [0, *drafts], 0, [1], (sample,), draft_token_ids=drafts)
        logits = torch.stack([_model_logits(prompt + spec + drafts[:j]) for j in range(len(drafts) + 1)])
        r = verify(spec_sampler, logits, [chunk], [0])[sid]
        for e in [*r.accepted, r]:
            spec.append(e.token_id)
            spec_lp.append((e.logprob, e.top_logprobs))
    assert spec[:steps] == plain
    assert spec_lp[:steps] == plain_lp


def test_every_option_but_structured_output_may_speculate() -> None:
    assert may_speculate(SamplingParams())
    assert may_speculate(SamplingParams(temperature=0.5, repetition_penalty=1.2, logprobs=3, logit_bias={1: 2.0}))
    assert not may_speculate(SamplingParams(structured=StructuredOutputs(choice=["a", "b"])))
