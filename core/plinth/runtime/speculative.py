"""Verifying draft tokens (speculative decoding): which requests may draft, and the rejection sampling.

A speculating chunk is ``[t, d_1 .. d_k]``: the sequence's last token ``t`` and ``k`` draft tokens
(``plinth.sched.draft``). One forward gives the target distribution ``p_j`` after every prefix
``t, d_1 .. d_j`` (``j = 0 .. k``). The verifier samples one token ``x_j`` from every ``p_j`` exactly
as a plain step would (penalties over the output so far plus ``d_1 .. d_j``, the logit bias,
temperature, top-k/top-p/min-p; the argmax for greedy rows), accepts drafts while ``d_{j+1} == x_j``
and emits ``x_0 .. x_a``: the ``a`` accepted drafts (``x_j == d_{j+1}``), then ``x_a``, which is the
correction at the first mismatch or the bonus token when all ``k`` were accepted.

Why this preserves the distribution exactly. Each ``x_j`` with ``j <= a`` is drawn from the
distribution the target gives after the *true* prefix (the drafts before it were all accepted, so
the prefix is what plain decoding would have produced), and whether to go on past ``j`` depends
only on ``x_j`` itself. So the emitted tokens are distributed as ``a + 1`` sequential plain steps.
Seen as the standard rejection rule for a point-mass draft ``q = delta(d)``: the draft is accepted
with probability ``P(x_j = d) = p_j(d) = min(1, p_j(d) / q(d))``, and on rejection the token emitted
is ``x_j`` given ``x_j != d``, distributed as ``p_j`` with ``d`` removed and renormalised, which is
the residual ``max(0, p_j - q)`` normalised. Greedy rows are the special case where ``p_j`` is a
point mass on the argmax.

Drawing ``x_j`` with the plain step's own sampler (the exponential race, one noise row per token)
has one more property: a seeded sequence's generator advances by exactly one row per *emitted*
token (the rows drawn for rejected positions are rewound), so a seeded request returns the same
tokens with and without speculation, whatever else shares its steps.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from plinth.runtime.sampler import Sampler, SampleResult
from plinth.sampling_params import SamplingParams
from plinth.sched.output import ScheduledChunk
from plinth.sched.request import Sample, SequenceId

if TYPE_CHECKING:
    from plinth.structured.masks import StepMasks


def may_speculate(params: SamplingParams) -> bool:
    """Whether a request with these parameters may get draft tokens: the one predicate for it
    (``NgramDrafter``'s ``allow``), where an option that cannot be verified per position says no.

    Structured output cannot: its grammar matcher advances one token per step, and the step's
    bitmask is for the position after the known tokens only. Every other option can: penalties
    see the drafts before each position as output, the logit bias is the same at every position,
    the seeded generators rewind, and logprobs are computed for every emitted token. ``n`` > 1 is
    the scheduler's (no drafts at the fork's first step).
    """
    return params.structured is None


def logit_rows(scheduled: list[ScheduledChunk[SamplingParams]], sampling: list[int]) -> list[int]:
    """The flattened token index of every logits row a step with drafts needs: the last token of
    each sampling chunk (``sampling`` indexes ``scheduled``), or its last ``1 + k`` with ``k`` drafts."""
    rows: list[int] = []
    end = 0
    ends = []
    for s in scheduled:
        end += len(s.token_ids)
        ends.append(end)
    for i in sampling:
        k = len(scheduled[i].draft_token_ids)
        rows.extend(range(ends[i] - 1 - k, ends[i]))
    return rows


def _draft_sample(sample: Sample[SamplingParams], drafts: list[int]) -> Sample[SamplingParams]:
    """The sample taken after ``drafts`` were appended: its penalties count them as output."""
    if not drafts or not sample.params.has_penalties:
        return sample  # nothing reads the output list: share it
    return dataclasses.replace(sample, output_token_ids=[*sample.output_token_ids, *drafts])


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    scheduled: list[ScheduledChunk[SamplingParams]],
    sampling: list[int],
    masks: StepMasks | None = None,
) -> dict[SequenceId, SampleResult]:
    """Sample a step with draft tokens; ``logits`` [R, V] has the rows :func:`logit_rows` lists.
    ``masks`` are the step's grammar masks, for its constrained samples (never speculating ones).

    A chunk without drafts gets its samples as in a plain step. A chunk with ``k`` drafts gets one
    result: the token emitted last, with the accepted drafts' results (``SampleResult.accepted``)
    before it; see the module docstring.
    """
    samples: list[Sample[SamplingParams]] = []
    rows: list[int] = []  # the logits row each sample reads
    row = 0
    for i in sampling:
        chunk = scheduled[i]
        drafts = chunk.draft_token_ids
        if not drafts:
            samples.extend(chunk.samples)
            rows.extend([row] * len(chunk.samples))
            row += 1
            continue
        (sample,) = chunk.samples  # the scheduler never drafts for a fork's first step
        for j in range(len(drafts) + 1):
            samples.append(_draft_sample(sample, drafts[:j]))
            rows.append(row + j)
        row += len(drafts) + 1
    # seeded speculating rows: their generators' states before the step, to rewind the rejected rows
    states = {
        c.seq_id: sampler.generator_state(c.samples[0])
        for c in (scheduled[i] for i in sampling)
        if c.draft_token_ids and c.samples[0].seed is not None and not c.samples[0].params.greedy
    }
    results = sampler.sample(logits, samples, rows, masks, writable=True)  # the step's own logits
    out: dict[SequenceId, SampleResult] = {}
    at = 0
    for i in sampling:
        chunk = scheduled[i]
        drafts = chunk.draft_token_ids
        if not drafts:
            for sample in chunk.samples:
                out[sample.seq_id] = results[at]
                at += 1
            continue
        targets = results[at : at + len(drafts) + 1]
        at += len(drafts) + 1
        a = 0
        while a < len(drafts) and targets[a].token_id == drafts[a]:
            a += 1
        last = targets[a]
        last.accepted = targets[:a]
        out[chunk.seq_id] = last
        state = states.get(chunk.seq_id)
        if state is not None and a < len(drafts):  # the rows past x_a were drawn for nothing
            sampler.rewind(chunk.samples[0], state, a + 1, logits.shape[-1])
    return out
