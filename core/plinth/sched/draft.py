"""Draft tokens for speculative decoding: who may speculate, and the n-gram (prompt-lookup) proposer.

A *drafter* proposes, for a running sequence with one token left to compute (a decode), up to
``k`` tokens that probably follow it. The scheduler schedules ``[last token, *drafts]`` as one
multi-token chunk; the sampler verifies the drafts against the model's own next-token
distributions, and ``Scheduler.update`` keeps the accepted prefix and rolls the rest back
(``plinth.runtime.speculative`` has the verification and the proof that it preserves the
distribution). Torch-free, like the rest of ``sched``.

``NoDrafter`` is the null drafter (speculation off); ``NgramDrafter`` looks the sequence's last
``n`` tokens up in its own prompt + output, the way vLLM's ``[ngram]`` method does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol

from plinth.sched.request import P, Request


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters since start: sequence-steps that carried drafts, draft tokens, accepted draft tokens."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One sequence's verified step: ``num_draft_tokens`` proposed, ``num_accepted`` of them taken."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed ones (0.0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a speculating sequence got per step: its accepted drafts plus the one it samples
        anyway (1.0 before any; ``1 + k`` at most)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class Drafter(Protocol[P]):
    """Proposes draft tokens for one decoding sequence (called by the scheduler, once per step)."""

    def propose(self, request: Request[P], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens to follow ``request``'s known tokens; ``[]``: no draft.

        :param max_tokens: the most the step may take (>= 1): what the token budget, ``max_tokens``
            and the context length leave after the sequence's own token.
        """
        ...


class NoDrafter:
    """Speculation off: never proposes anything."""

    def propose(self, request: Request[P], max_tokens: int) -> list[int]:
        """Always ``[]``."""
        return []


def ngram_lookup(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The ``k`` tokens that followed the most recent earlier occurrence of ``tokens``' last ``n``
    tokens, for the largest ``n`` in ``n_max .. n_min`` that occurs; ``[]`` when none does.

    When fewer than ``k`` tokens follow the occurrence (it overlaps the suffix: the sequence repeats
    with a period shorter than ``k``), the drafts continue with what they copied, i.e. the period
    repeats, as plain copying would. O(len(tokens) * n_max) in the worst case, scanned from the end:
    a sequence that repeats itself finds its match within the last few hundred tokens.
    """
    length = len(tokens)
    if length < n_min + 1 or k < 1:
        return []
    last = tokens[-1]
    best_end, best_len = -1, 0
    # candidate ends j (tokens[j] == last), most recent first; j < length - 1: something follows it
    for j in range(length - 2, n_min - 2, -1):
        if tokens[j] != last:
            continue
        m = 1
        while m < n_max and j - m >= 0 and tokens[j - m] == tokens[length - 1 - m]:
            m += 1
        if m > best_len:  # only a longer match replaces a more recent one
            best_end, best_len = j, m
            if m == n_max:
                break
    if best_len < n_min:
        return []
    drafts = tokens[best_end + 1 : best_end + 1 + k]
    period = length - 1 - best_end
    while len(drafts) < k:  # the copy runs into the suffix itself: keep copying (drafts included)
        drafts.append(drafts[len(drafts) - period])
    return drafts


class NgramDrafter(Generic[P]):
    """Prompt-lookup drafting: propose what followed the last ``n`` tokens the previous time.

    :param num_speculative_tokens: ``k``, the most draft tokens per step (>= 1).
    :param n_max: the longest suffix looked up (>= ``n_min``).
    :param n_min: the shortest suffix that counts as a match (>= 1); 1 drafts after any repeated
        token, which on text that does not repeat itself mostly proposes tokens that are rejected.
    :param allow: whether a request's sampling parameters allow drafting at all (the engine's
        ``plinth.runtime.speculative.may_speculate``); the scheduler itself sees the parameters as
        opaque.
    """

    def __init__(
        self, num_speculative_tokens: int, n_max: int, n_min: int, allow: Callable[[P], bool] = lambda _: True
    ) -> None:
        if num_speculative_tokens < 1 or n_min < 1 or n_max < n_min:
            raise ValueError(
                f"need num_speculative_tokens >= 1 and 1 <= n_min <= n_max; got {num_speculative_tokens}, "
                f"n_min={n_min}, n_max={n_max}"
            )
        self.k = num_speculative_tokens
        self.n_max = n_max
        self.n_min = n_min
        self._allow = allow

    def propose(self, request: Request[P], max_tokens: int) -> list[int]:
        """The n-gram lookup over the request's prompt + output, capped at ``min(k, max_tokens)``."""
        if not self._allow(request.params):
            return []
        return ngram_lookup(request.all_token_ids, min(self.k, max_tokens), self.n_max, self.n_min)
