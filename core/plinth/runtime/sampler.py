"""Turning logits into tokens: penalties, logit bias, grammar masks, temperature, top-k/top-p/min-p,
seeds, logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from plinth.platform.backend import SmallOps
from plinth.sampling_params import SamplingParams
from plinth.sched.request import Sample, SequenceId

if TYPE_CHECKING:
    from plinth.structured.masks import StepMasks


@dataclass(slots=True)
class SampleResult:
    """The sampled token and, when asked for, its logprob and the top-n alternatives.

    ``accepted``: after a step with draft tokens (``plinth.runtime.speculative``), the results of
    the drafts accepted before ``token_id``, in order; empty otherwise.
    """

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    accepted: list[SampleResult] = field(default_factory=list)


class Sampler:
    """Samples one token per :class:`~plinth.sched.request.Sample`.

    Logprobs are those of the model's raw distribution (before penalties and temperature), as the
    OpenAI API reports them. Seeded rows draw from their own generator, kept across steps, so a
    seeded request yields the same tokens whatever else is in the batch.

    :param ops: the backend's small ops; their ``argmax`` picks the tokens (default: plain torch).
    """

    def __init__(self, ops: SmallOps | None = None) -> None:
        self._generators: dict[SequenceId, torch.Generator] = {}
        ops = ops or SmallOps()
        self._argmax = ops.argmax  # looked up once, not per step
        self._apply_bitmask = ops.apply_token_bitmask

    def forget(self, seq_id: SequenceId) -> None:
        """Drop the generator of a finished sequence."""
        self._generators.pop(seq_id, None)

    def _generator(self, seq_id: SequenceId, seed: int) -> torch.Generator:
        gen = self._generators.get(seq_id)
        if gen is None:
            gen = torch.Generator()
            gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # any int (seed + sample index) maps into uint64
            self._generators[seq_id] = gen
        return gen

    def generator_state(self, sample: Sample[SamplingParams]) -> torch.Tensor:
        """The state of a seeded sample's generator (made now if it has none yet), for :meth:`rewind`."""
        assert sample.seed is not None
        return self._generator(sample.seq_id, sample.seed).get_state()

    def rewind(self, sample: Sample[SamplingParams], state: torch.Tensor, draws: int, vocab: int) -> None:
        """Put a seeded sample's generator back to ``state`` advanced by ``draws`` noise rows of
        ``vocab``: as if a step with draft tokens had drawn rows only for the tokens it emitted."""
        gen = self._generators[sample.seq_id]
        gen.set_state(state)
        row = torch.empty(vocab)
        for _ in range(draws):  # row by row, as sample() draws them
            row.exponential_(generator=gen)

    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[Sample[SamplingParams]],
        logits_rows: list[int],
        masks: StepMasks | None = None,
        writable: bool = False,
    ) -> list[SampleResult]:
        """``logits`` [L, V] -> one result per sample; sample ``i`` reads logits row ``logits_rows[i]``
        (the ``n`` samples of a fork read the same row). A seeded sample draws from the generator
        of its ``seq_id``, made from its seed the first time and kept until :meth:`forget`.
        ``masks`` holds the allowed tokens of the constrained samples (structured output), applied
        after penalties and biases, before temperature and the filters. ``writable``: the caller
        reads ``logits`` no more (the runner's own logits), so penalties, biases and masks rewrite
        its rows in place instead of in a copy (a [S, V] copy is a parallel region on the pool)."""
        logits = logits.float()
        if logits_rows != list(range(logits.shape[0])):  # n > 1 repeats rows; else the logits are in order
            logits = logits.index_select(0, torch.tensor(logits_rows, dtype=torch.long, device=logits.device))  # [S, V]
        elif not writable and (masks is not None or any(r.params.changes_logits for r in rows)):
            logits = logits.clone()  # penalties, biases and masks write rows in place: never the caller's tensor
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        for i, row in enumerate(rows):
            if row.params.has_penalties:
                logits[i] = apply_penalties(logits[i], row.params, row.prompt_token_ids, row.output_token_ids)
            if row.params.logit_bias:
                apply_logit_bias(logits[i], row.params.logit_bias)
        if masks is not None:
            self._mask(logits, rows, masks)

        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if len(greedy) == len(rows):  # all greedy: no row selection (a [S, V] copy each)
            tokens = self._argmax(logits)
        elif greedy:
            g = torch.tensor(greedy, dtype=torch.long, device=logits.device)
            tokens[g] = self._argmax(logits.index_select(0, g))
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random:
            r_idx = torch.tensor(random, dtype=torch.long, device=logits.device)
            probs = filtered_probs(logits.index_select(0, r_idx), [rows[i].params for i in random])
            # argmax(p / Exp(1)) draws from p (the exponential race): one vectorised pass instead of
            # a multinomial per row; seeded rows fill their noise from their own generator
            noise = torch.empty_like(probs)
            unseeded = []
            for j, i in enumerate(random):
                row = rows[i]
                if row.seed is None:
                    unseeded.append(j)
                else:
                    noise[j].exponential_(generator=self._generator(row.seq_id, row.seed))
            if unseeded:
                u = torch.tensor(unseeded, dtype=torch.long, device=logits.device)
                noise.index_copy_(0, u, torch.empty(len(unseeded), probs.shape[1], device=logits.device).exponential_())
            tokens[r_idx] = self._argmax(probs / noise)

        token_list = tokens.tolist()
        results = []
        for i, row in enumerate(rows):
            result = SampleResult(token_id=token_list[i])
            if raw_logprobs is not None and row.params.logprobs is not None:
                result.logprob = float(raw_logprobs[i, token_list[i]])
                if row.params.logprobs > 0:
                    values, ids = raw_logprobs[i].topk(row.params.logprobs)
                    result.top_logprobs = list(zip(ids.tolist(), values.tolist(), strict=True))
                else:
                    result.top_logprobs = []
            results.append(result)
        return results

    def _mask(self, logits: torch.Tensor, rows: Sequence[Sample[SamplingParams]], masks: StepMasks) -> None:
        """Forbid, in place, the tokens each constrained row's grammar does not allow now."""
        picked = [(i, masks.rows[r.seq_id]) for i, r in enumerate(rows) if r.seq_id in masks.rows]
        if not picked:
            return
        bitmask = masks.bitmask()
        mask_rows = [m for _i, m in picked]
        if mask_rows != list(range(bitmask.shape[0])):
            bitmask = bitmask.index_select(0, torch.tensor(mask_rows, dtype=torch.long))
        bitmask = bitmask.to(logits.device)
        if len(picked) == len(rows):
            self._apply_bitmask(logits, bitmask)
            return
        idx = torch.tensor([i for i, _m in picked], dtype=torch.long, device=logits.device)
        sub = logits.index_select(0, idx)
        self._apply_bitmask(sub, bitmask)
        logits.index_copy_(0, idx, sub)


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> None:
    """Add ``bias`` (token id -> bias) to ``logits`` [V] in place; ids are checked against the
    vocabulary when the request is added (:meth:`LLMEngine.add_request`)."""
    ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
    values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    logits.index_add_(0, ids, values)


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """Repetition (over prompt and output), presence and frequency (over the output) penalties.

    ``logits`` [V] -> [V].
    """
    vocab = logits.shape[0]
    logits = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        ids = torch.tensor(prompt_ids + output_ids, dtype=torch.long, device=logits.device)
        seen[ids[ids < vocab]] = True
        p = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    if output_ids and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
        out = torch.tensor(output_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filtering; ``logits`` [S, V] -> probabilities [S, V]."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits = logits / temps[:, None]
    if all(p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
        return torch.softmax(logits, dim=-1)  # no filter: skip the vocabulary sort
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device)

    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # keep the smallest prefix whose mass reaches top_p: a token goes when the mass before it does
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p[:, None]
    drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    masked = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return torch.softmax(masked, dim=-1)
