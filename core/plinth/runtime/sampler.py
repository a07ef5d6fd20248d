"""Turning logits into tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plinth.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRow:
    """One token to sample. Several rows may read the same logits row (the n samples of a fork)."""

    logits_index: int
    params: SamplingParams
    key: str  # the sequence that receives the token: owns the seeded generator
    seed: int | None
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass(slots=True)
class SampleResult:
    """The sampled token and, when asked for, its logprob and the top-n alternatives."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Sampler:
    """Samples one token per :class:`SampleRow`.

    Logprobs are those of the model's raw distribution (before penalties and temperature), as the
    OpenAI API reports them. Seeded rows draw from their own generator, kept across steps, so a
    seeded request yields the same tokens whatever else is in the batch.
    """

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, key: str) -> None:
        """Drop the generator of a finished sequence."""
        self._generators.pop(key, None)

    def _generator(self, key: str, seed: int) -> torch.Generator:
        gen = self._generators.get(key)
        if gen is None:
            gen = torch.Generator()
            gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # any int (seed + sample index) maps into uint64
            self._generators[key] = gen
        return gen

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[SampleResult]:
        """``logits`` [L, V] -> one result per row."""
        logits = logits.float()
        order = [r.logits_index for r in rows]
        if order != list(range(logits.shape[0])):  # n > 1 repeats rows; else the logits are in order
            logits = logits.index_select(0, torch.tensor(order, dtype=torch.long, device=logits.device))  # [S, V]
        elif any(r.params.has_penalties for r in rows):
            logits = logits.clone()  # penalties write rows in place: never into the caller's tensor
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        for i, row in enumerate(rows):
            if row.params.has_penalties:
                logits[i] = apply_penalties(logits[i], row.params, row.prompt_ids, row.output_ids)

        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if len(greedy) == len(rows):  # all greedy: no row selection (a [S, V] copy each)
            tokens = argmax_rows(logits)
        elif greedy:
            g = torch.tensor(greedy, dtype=torch.long, device=logits.device)
            tokens[g] = argmax_rows(logits.index_select(0, g))
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
                    noise[j].exponential_(generator=self._generator(row.key, row.seed))
            if unseeded:
                u = torch.tensor(unseeded, dtype=torch.long, device=logits.device)
                noise.index_copy_(0, u, torch.empty(len(unseeded), probs.shape[1], device=logits.device).exponential_())
            tokens[r_idx] = argmax_rows(probs / noise)

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


#: Vocabulary slice of :func:`argmax_rows`; rows shorter than ``4 * ARGMAX_CHUNK`` take one argmax.
ARGMAX_CHUNK = 1024


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor (the first index of each row's maximum; a NaN counts as the
    maximum, as in torch), in two passes: the maximum of each ``ARGMAX_CHUNK``-wide slice, then one
    argmax inside the first slice that holds the row's maximum.

    torch's CPU argmax runs at about a tenth of the speed of its max-reduction (64 rows of a 49,152-token
    vocabulary: 3.9 ms against 0.6 ms this way, 2 threads; a 64-sequence decode step of SmolLM2 Q4_1
    200 -> 190 ms). A single row takes torch's argmax: it runs on the calling thread, where the slices'
    maxima would wake torch's worker threads, which then spin against the cpu backend's own (batch 1:
    +2.2 ms a token).
    """
    rows, width = x.shape
    c = ARGMAX_CHUNK
    if rows < 2 or width < 4 * c or x.device.type != "cpu":
        return x.argmax(dim=-1)
    n = width // c
    slice_max = x[:, : n * c].reshape(rows, n, c).amax(dim=-1)  # [S, n]
    if width > n * c:  # the short last slice
        slice_max = torch.cat([slice_max, x[:, n * c :].amax(dim=-1, keepdim=True)], dim=1)
    first = slice_max.argmax(dim=-1)  # [S]: the first slice holding the maximum (or a NaN)
    # a window of c ending at the row's end for the short slice: what it overlaps of the slice before
    # holds no maximum (that slice is not the first to hold one)
    start = torch.clamp(first * c, max=width - c)
    window = x.gather(1, start[:, None] + torch.arange(c, device=x.device))  # [S, c]
    return start + window.argmax(dim=-1)


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
