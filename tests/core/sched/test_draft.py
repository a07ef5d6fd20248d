"""Speculative decoding in the scheduler: n-gram lookup, draft chunks, the budget, rollback, blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from plinth.sched.draft import NgramDrafter, NoDrafter, SpecDecodeStats, ngram_lookup
from plinth.sched.request import Request, RequestStatus, SequenceId, StopCriteria
from plinth.sched.scheduler import Scheduler

CORE = Path(__file__).resolve().parents[3] / "core"


# -- the n-gram lookup -----------------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_most_recent_occurrence() -> None:
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    assert ngram_lookup(tokens, 2, n_max=3, n_min=1) == [8, 7]  # the later "1 2 3" wins
    assert ngram_lookup(tokens, 5, n_max=3, n_min=1) == [8, 7, 1, 2, 3]


def test_lookup_prefers_the_longest_match_then_recency() -> None:
    tokens = [5, 6, 7, 1, 4, 6, 7, 2, 5, 6, 7]
    # "6 7" occurs twice (most recent followed by 2), but "5 6 7" only at the start (followed by 1)
    assert ngram_lookup(tokens, 1, n_max=3, n_min=1) == [1]
    assert ngram_lookup(tokens, 1, n_max=2, n_min=1) == [2]


def test_lookup_respects_n_min_and_empty_cases() -> None:
    assert ngram_lookup([1, 2, 3, 4, 3], 3, n_max=3, n_min=2) == []  # only "3" repeats
    assert ngram_lookup([1, 2, 3, 4, 3], 3, n_max=3, n_min=1) == [4, 3, 4]
    assert ngram_lookup([7], 3, n_max=3, n_min=1) == []
    assert ngram_lookup([1, 2, 1, 2], 0, n_max=3, n_min=1) == []


def test_lookup_of_a_short_period_keeps_copying() -> None:
    assert ngram_lookup([4, 4, 4, 4], 3, n_max=3, n_min=1) == [4, 4, 4]
    assert ngram_lookup([1, 2, 1, 2, 1, 2], 5, n_max=2, n_min=2) == [1, 2, 1, 2, 1]


def test_drafter_caps_and_asks_the_predicate() -> None:
    req = _req("a", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=8)
    assert NgramDrafter(4, 3, 1).propose(req, 2) == [3, 1]
    assert NgramDrafter(4, 3, 1, allow=lambda params: params != "no").propose(req, 9) == [3, 1, 2, 3]
    req.params = "no"
    assert NgramDrafter(4, 3, 1, allow=lambda params: params != "no").propose(req, 9) == []
    assert NoDrafter().propose(req, 4) == []
    with pytest.raises(ValueError):
        NgramDrafter(4, 1, 2)


def test_stats() -> None:
    stats = SpecDecodeStats()
    assert (stats.acceptance_rate, stats.tokens_per_step) == (0.0, 1.0)
    stats.record(4, 3)
    stats.record(4, 1)
    assert stats.acceptance_rate == 0.5
    assert stats.tokens_per_step == 3.0


def test_draft_module_does_not_import_torch() -> None:
    code = "import sys, plinth.sched.draft; assert 'torch' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": str(CORE)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


# -- the scheduler with drafts ---------------------------------------------------------------------


class FixedDrafter:
    """Proposes ``drafts`` (capped) for every request it is asked about, and records the caps."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts
        self.caps: list[int] = []

    def propose(self, request: Request[Any], max_tokens: int) -> list[int]:
        self.caps.append(max_tokens)
        return self.drafts[:max_tokens]


def _req(rid: str, prompt: list[int] | int, max_tokens: int = 16, n: int = 1, **stop: Any) -> Request[Any]:
    base = 1000 * sum(map(ord, rid))
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else list(prompt)
    return Request(request_id=rid, prompt_token_ids=tokens, stop=StopCriteria(max_tokens, **stop), params=None, n=n)


def _sched(drafter: Any, **kw: int) -> Scheduler[Any]:
    args: dict[str, Any] = dict(
        num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64
    )
    args.update(kw)
    return Scheduler(**args, drafter=drafter)


def sid(rid: str, k: int = 0) -> SequenceId:
    return SequenceId(rid, k)


def test_decode_gets_drafts_behind_its_last_token_and_rolls_back_the_rejected() -> None:
    s = _sched(FixedDrafter([50, 51, 52]))
    r = _req("a", 6)
    s.add_request(r)
    out = s.schedule()  # the prefill: no drafts
    assert out.scheduled[0].draft_token_ids == []
    s.update(out, {sid("a"): 10})
    out = s.schedule()
    (chunk,) = out.scheduled
    assert chunk.token_ids == [10, 50, 51, 52]
    assert chunk.draft_token_ids == [50, 51, 52]
    assert chunk.start_position == 6
    assert out.num_batched_tokens == 4
    assert r.num_computed_tokens == 10
    assert len(chunk.block_ids) == 3  # 10 slots of 4
    # the sampler accepted 50 and then sampled 60 instead of 51
    s.update(out, {sid("a"): 60}, {sid("a"): [50]})
    assert r.output_token_ids == [10, 50, 60]
    assert r.num_computed_tokens == 8  # 6 prompt + 10 + 50; 60 is computed next step
    assert s.kv_cache_manager.block_ids(sid("a")) == chunk.block_ids[:2]  # the block only 51/52 used is back
    assert s.spec_stats == SpecDecodeStats(1, 3, 1)


def test_all_accepted_gets_the_bonus_token() -> None:
    s = _sched(FixedDrafter([50, 51]))
    r = _req("a", 3)
    s.add_request(r)
    s.update(s.schedule(), {sid("a"): 10})
    out = s.schedule()
    s.update(out, {sid("a"): 99}, {sid("a"): [50, 51]})
    assert r.output_token_ids == [10, 50, 51, 99]
    assert r.num_computed_tokens == 6


def test_drafts_are_capped_by_budget_max_tokens_and_context() -> None:
    d = FixedDrafter(list(range(100, 110)))
    s = _sched(d, max_num_batched_tokens=16)
    r = _req("a", 4, max_tokens=5)
    s.add_request(r)
    s.update(s.schedule(), {sid("a"): 10})
    out = s.schedule()
    # max_tokens 5 with 1 output: 4 more at most, one of them the sampled token
    assert out.scheduled[0].draft_token_ids == [100, 101, 102]
    assert d.caps[-1] == 3
    s.update(out, {sid("a"): 7}, {sid("a"): [100, 101, 102]})
    assert r.is_finished and r.output_token_ids == [10, 100, 101, 102, 7]

    d = FixedDrafter(list(range(100, 110)))
    s = _sched(d, max_model_len=8)
    r = _req("b", 5, max_tokens=3)
    s.add_request(r)
    s.update(s.schedule(), {sid("b"): 10})
    out = s.schedule()
    assert d.caps[-1] == 1  # 6 tokens of 8: the sampled token and one draft
    assert out.scheduled[0].draft_token_ids == [100]


def test_budget_left_for_drafts_after_a_prefill() -> None:
    d = FixedDrafter(list(range(100, 110)))
    s = _sched(d, max_num_batched_tokens=16)
    a = _req("a", 4, max_tokens=30)
    s.add_request(a)
    s.update(s.schedule(), {sid("a"): 10})
    s.add_request(_req("b", 30))
    out = s.schedule()  # a decodes first with 10 drafts (11 tokens), b's prompt gets the 5 left
    assert [len(c.token_ids) for c in out.scheduled] == [11, 5]
    assert out.num_batched_tokens == 16
    s.update(out, {sid("a"): 1}, {})
    d.drafts = list(range(200, 220))
    out = s.schedule()
    assert out.scheduled[0].draft_token_ids == list(range(200, 215))  # the whole budget minus one
    assert out.num_batched_tokens == 16


def test_no_drafts_for_a_forks_first_step_nor_prefill_chunks() -> None:
    d = FixedDrafter([50, 51])
    s = _sched(d, max_num_batched_tokens=4)
    s.add_request(_req("a", 6, n=2))
    out = s.schedule()  # a prefill chunk of 4
    assert out.scheduled[0].draft_token_ids == []
    s.update(out, {})
    out = s.schedule()  # the rest of the prompt, and the fork's first samples
    assert out.scheduled[0].draft_token_ids == [] and out.scheduled[0].num_samples == 2
    s.update(out, {sid("a"): 10, sid("a", 1): 11})
    out = s.schedule()  # both forks decode: the first takes 3 of the budget of 4, the second gets 1
    assert [c.draft_token_ids for c in out.scheduled] == [[50, 51], []]
    assert d.caps == [3]  # the second had no budget left for a draft: never asked


def test_a_stop_among_the_accepted_drops_what_follows() -> None:
    s = _sched(FixedDrafter([50, 2, 52]))
    r = _req("a", 3, eos_token_ids=frozenset({2}))
    s.add_request(r)
    s.update(s.schedule(), {sid("a"): 10})
    out = s.schedule()
    done = s.update(out, {sid("a"): 53}, {sid("a"): [50, 2, 52]})
    assert done == [r] and r.status is RequestStatus.FINISHED_STOPPED
    assert r.output_token_ids == [10, 50, 2]
    assert s.kv_cache_manager.num_free_blocks == 63  # everything back


def test_min_tokens_lets_an_accepted_eos_through() -> None:
    s = _sched(FixedDrafter([2, 2, 2]))
    r = _req("a", 3, eos_token_ids=frozenset({2}), min_tokens=3)
    s.add_request(r)
    s.update(s.schedule(), {sid("a"): 10})
    s.update(s.schedule(), {sid("a"): 2}, {sid("a"): [2, 2, 2]})
    assert r.output_token_ids == [10, 2, 2, 2]  # the eos at output index 3 stops it
    assert r.status is RequestStatus.FINISHED_STOPPED


def test_no_room_for_the_lookahead_decodes_without_it_before_preempting() -> None:
    # 5 usable blocks of 4: a holds 2 (6 tokens + its next), b holds 3
    s = _sched(FixedDrafter([50, 51, 52, 53]), num_blocks=6, max_model_len=20)
    a, b = _req("a", 6), _req("b", 11)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.update(out, {sid("a"): 10, sid("b"): 20})
    out = s.schedule()
    assert out.preempted_ids == []
    assert [c.draft_token_ids for c in out.scheduled] == [[], []]


def test_pool_returns_to_its_start_after_random_speculating_steps() -> None:
    import random

    rng = random.Random(0)
    d = FixedDrafter([])
    s = _sched(d, num_blocks=12, max_num_batched_tokens=12, max_model_len=40)
    free0 = s.kv_cache_manager.num_free_blocks
    for i in range(10):
        s.add_request(_req(f"r{i}", rng.randrange(2, 12), max_tokens=rng.randrange(2, 20)))
    steps = 0
    while s.has_unfinished():
        d.drafts = [rng.randrange(100) for _ in range(rng.randrange(0, 6))]
        out = s.schedule()
        sampled, accepted = {}, {}
        for c in out.scheduled:
            for smp in c.samples:
                sampled[smp.seq_id] = rng.randrange(100)
            if c.draft_token_ids:
                accepted[c.seq_id] = c.draft_token_ids[: rng.randrange(len(c.draft_token_ids) + 1)]
        s.update(out, sampled, accepted)
        for r in s.running:  # the table covers the computed tokens, no more (outside a step)
            assert len(s.kv_cache_manager.block_ids(r.seq_id)) == -(-r.num_computed_tokens // 4)
            assert r.num_computed_tokens < r.num_tokens
        steps += 1
        assert steps < 500
    assert s.spec_stats.num_drafts > 10
    assert s.num_preemptions_total > 0
    assert s.kv_cache_manager.num_free_blocks == free0


def test_accepted_tokens_must_be_a_prefix_of_the_drafts() -> None:
    s = _sched(FixedDrafter([50, 51]))
    s.add_request(_req("a", 3))
    s.update(s.schedule(), {sid("a"): 10})
    out = s.schedule()
    with pytest.raises(ValueError, match="prefix"):
        s.update(out, {sid("a"): 1}, {sid("a"): [51]})
