"""Scheduler unit tests: budget, chunking, FIFO, preemption, forks, stop conditions, aborts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from plinth.sched.output import EngineFinishes, SchedulerOutput
from plinth.sched.request import Request, RequestStatus, SequenceId, StopCriteria
from plinth.sched.scheduler import Scheduler

CORE = Path(__file__).resolve().parents[3] / "core"


def make(
    rid: str, prompt: list[int] | int, max_tokens: int = 4, n: int = 1, seed: int | None = None, **stop: Any
) -> Request:
    # an int prompt gets tokens of its own (no accidental prefix hits between requests)
    base = 1000 * sum(map(ord, rid))
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else list(prompt)
    stop_criteria = StopCriteria(max_tokens, **stop)
    return Request(request_id=rid, prompt_token_ids=tokens, stop=stop_criteria, params=None, seed=seed, n=n)


def sid(rid: str, sample_index: int = 0) -> SequenceId:
    return SequenceId(rid, sample_index)


def sched(**kw: int | bool) -> Scheduler:
    args: dict[str, int | bool] = dict(
        num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64
    )
    args.update(kw)
    return Scheduler(**args)  # type: ignore[arg-type]


def step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    out = s.schedule()
    # sample i of a chunk gets token + i
    sampled = {smp.seq_id: token + i for x in out.scheduled for i, smp in enumerate(x.samples)}
    return out, s.update(out, sampled)


def chunks(out: SchedulerOutput) -> dict[str, tuple[int, int, int]]:
    """request id -> (start, num tokens, num_samples), for steps without forks running."""
    assert all(x.seq_id.sample_index == 0 for x in out.scheduled)
    return {x.seq_id.request_id: (x.start_position, len(x.token_ids), x.num_samples) for x in out.scheduled}


def test_sched_package_does_not_import_torch() -> None:
    code = (
        "import sys, plinth.sched.scheduler, plinth.sched.kv_cache_manager, plinth.sched.block_pool; "
        "assert 'torch' not in sys.modules, 'plinth.sched imported torch'"
    )
    env = {**os.environ, "PYTHONPATH": str(CORE)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_add_request_guards() -> None:
    s = sched(max_model_len=16, max_num_seqs=2)
    with pytest.raises(ValueError, match="empty prompt"):
        s.add_request(make("a", []))
    with pytest.raises(ValueError, match="16 tokens.*max_model_len=16"):
        s.add_request(make("a", 16))
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_request(make("a", 3, max_tokens=0))
    with pytest.raises(ValueError, match="n=3"):
        s.add_request(make("a", 3, n=3))
    s.add_request(make("a", 15))
    with pytest.raises(ValueError, match="in use"):
        s.add_request(make("a", 3))
    s.add_request(make("b", 3, n=2))
    s.add_request(make("b#1", 3))  # an id is a string like any other: no naming convention to collide with
    forked = make("c", 3)
    forked.sample_index = 1
    with pytest.raises(ValueError, match="only the scheduler forks"):
        s.add_request(forked)


def test_constructor_guards() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        Scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=13)
    with pytest.raises(ValueError, match="chunked"):
        Scheduler(8, 4, 8, 2, 16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="needs chunked prefill"):
        Scheduler(8, 4, 16, 2, 16, enable_chunked_prefill=False, long_prefill_token_threshold=4)


def test_chunked_prefill_then_decode() -> None:
    s = sched(max_num_batched_tokens=4)
    r = make("a", 10, max_tokens=2)
    s.add_request(r)
    out, got = step(s)
    assert chunks(out) == {"a": (0, 4, 0)} and got == [] and r.num_computed_tokens == 4
    assert out.scheduled[0].token_ids == r.prompt_token_ids[:4] and len(out.scheduled[0].block_ids) == 1
    out, _ = step(s)
    assert chunks(out) == {"a": (4, 4, 0)}
    out, got = step(s, token=5)
    assert chunks(out) == {"a": (8, 2, 1)} and got == [r] and r.output_token_ids == [5]
    assert len(out.scheduled[0].block_ids) == 3
    out, got = step(s, token=6)
    assert chunks(out) == {"a": (10, 1, 1)} and out.scheduled[0].token_ids == [5]
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [5, 6]
    assert not s.has_unfinished() and s.kv_usage == 0.0


def test_running_first_then_fifo_waiting_sharing_the_budget() -> None:
    s = sched(max_num_batched_tokens=8)
    a, b, c = make("a", 6), make("b", 6), make("c", 6)
    s.add_request(a)
    step(s)
    s.add_request(b)
    s.add_request(c)
    out, _ = step(s)
    assert [x.seq_id for x in out.scheduled] == [sid("a"), sid("b"), sid("c")]
    assert chunks(out) == {"a": (6, 1, 1), "b": (0, 6, 1), "c": (0, 1, 0)}  # c gets the budget's last token
    assert out.num_batched_tokens == 8
    out, _ = step(s)
    assert chunks(out) == {"a": (7, 1, 1), "b": (6, 1, 1), "c": (1, 5, 1)}


def test_max_num_seqs_and_long_prefill_threshold() -> None:
    s = sched(max_num_seqs=2, long_prefill_token_threshold=3)
    for rid in "abc":
        s.add_request(make(rid, 5))
    out, _ = step(s)
    assert chunks(out) == {"a": (0, 3, 0), "b": (0, 3, 0)} and s.num_waiting == 1
    out, _ = step(s)
    assert chunks(out) == {"a": (3, 2, 1), "b": (3, 2, 1)}


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    s = sched(max_num_batched_tokens=20, max_model_len=20, enable_chunked_prefill=False)
    s.add_request(make("a", 12))
    s.add_request(make("b", list(range(12))))
    out, _ = step(s)
    assert chunks(out) == {"a": (0, 12, 1)}
    out, _ = step(s)
    assert chunks(out) == {"a": (12, 1, 1), "b": (0, 12, 1)}


def test_preemption_by_recompute_of_the_latest_running_request() -> None:
    # 4 usable blocks of 4 tokens; a and b take 2 blocks each, then a needs a third
    s = sched(num_blocks=5, max_model_len=16, max_num_batched_tokens=32)
    a, b = make("a", list(range(8)), max_tokens=8), make("b", list(range(50, 57)), max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    step(s, token=1)
    c = make("c", [9, 9, 9])
    s.add_request(c)
    out, _ = step(s, token=2)  # a writes position 8: a third block, taken from b
    assert out.preempted_ids == [sid("b")] and chunks(out) == {"a": (8, 1, 1)}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [1] and b.num_preemptions == 1 and s.num_preemptions_total == 1
    assert s.kv_cache_manager.block_ids(sid("b")) == []
    assert list(s.waiting) == [b, c]  # preempted requests go to the front; no admission this step
    while a.status == RequestStatus.RUNNING:
        out, _ = step(s, token=3)
        assert out.preempted_ids == [] and "b" not in chunks(out)  # b cannot fit, a is not preempted
    out, _ = step(s, token=4)
    x = out.scheduled[0]
    # b recomputes prompt + its kept output (its cached first block was evicted by a meanwhile)
    assert x.seq_id == b.seq_id and x.start_position == 0 and x.token_ids == b.prompt_token_ids + [1]
    assert x.num_samples == 1 and b.output_token_ids == [1, 4]
    assert b.num_cached_prompt_tokens == 0


def test_the_victim_is_the_tail_of_the_running_queue() -> None:
    s = sched(num_blocks=7, max_model_len=16, max_num_batched_tokens=32)
    a = make("a", list(range(8)), max_tokens=8)
    b = make("b", list(range(50, 57)), max_tokens=8)
    c = make("c", list(range(60, 67)), max_tokens=8)
    for r in (a, b, c):
        s.add_request(r)
    step(s)  # 2 blocks each: the pool is full
    out, _ = step(s)  # a needs a third block; b writes position 7 in place
    assert out.preempted_ids == [sid("c")] and chunks(out) == {"a": (8, 1, 1), "b": (7, 1, 1)}
    assert [r.seq_id for r in s.running] == [sid("a"), sid("b")]


def test_a_request_preempts_itself_when_it_is_the_tail() -> None:
    s = sched(num_blocks=5, max_model_len=16, max_num_batched_tokens=32)
    a, b = make("a", list(range(9)), max_tokens=4), make("b", list(range(50, 54)), max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    step(s)  # a: 3 blocks, b: 1 full block; the pool is full
    out, _ = step(s)  # a writes position 9 in place; b needs a block for position 4
    assert out.preempted_ids == [sid("b")] and chunks(out) == {"a": (9, 1, 1)}
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.PREEMPTED
    while s.has_unfinished():
        step(s)
    assert b.output_token_ids == [7, 7, 7, 7] and s.kv_cache_manager.num_free_blocks == 4


def test_waiting_request_without_blocks_stays_waiting() -> None:
    s = sched(num_blocks=5, max_model_len=16)
    a = make("a", 12, max_tokens=8)
    s.add_request(a)
    step(s)
    b = make("b", [1, 2, 3, 4])
    s.add_request(b)
    out, _ = step(s)
    # a holds 3 blocks, takes the 4th for position 12; b would need one too: it waits, nobody is preempted
    assert chunks(out) == {"a": (12, 1, 1)} and out.preempted_ids == [] and list(s.waiting) == [b]
    assert b.status == RequestStatus.WAITING


def test_fork_n_samples_children_share_blocks_and_copy_on_write() -> None:
    s = sched()
    p = make("p", 6, max_tokens=3, n=3, eos_token_ids=frozenset({0}))
    s.add_request(p)
    out = s.schedule()
    assert chunks(out) == {"p": (0, 6, 3)}
    forks = [sid("p"), sid("p", 1), sid("p", 2)]
    assert [x.seq_id for x in out.scheduled[0].samples] == forks  # the scheduler names the forks
    got = s.update(out, {forks[0]: 10, forks[1]: 11, forks[2]: 12})
    assert [r.seq_id for r in got] == forks and all(r.request_id == "p" for r in got)
    assert [r.output_token_ids for r in got] == [[10], [11], [12]]
    assert [r.sample_index for r in got] == [0, 1, 2]
    assert p.forked and p.n == 3 and all(r.n == 1 for r in got[1:])
    assert got[1].stop == p.stop and got[1].stop is not p.stop
    assert [r.seq_id for r in s.running] == forks
    tables = s.kv_cache_manager.tables()
    assert tables[forks[0]] == tables[forks[1]] == tables[forks[2]]
    shared_partial = tables[forks[0]][1]
    out, got = step(s)
    assert all(x.num_samples == 1 for x in out.scheduled)
    assert [x.samples[0].seq_id for x in out.scheduled] == [x.seq_id for x in out.scheduled] == forks
    assert [src for src, _ in out.block_copies] == [shared_partial, shared_partial]
    assert [x.block_ids[1] for x in out.scheduled][2] == shared_partial
    assert len({x.block_ids[1] for x in out.scheduled}) == 3


def test_fork_child_abort_and_group_abort() -> None:
    s = sched()
    s.add_request(make("p", 6, max_tokens=5, n=3))
    out = s.schedule()
    s.update(out, {sid("p"): 1, sid("p", 1): 2, sid("p", 2): 3})
    assert s.abort_request(sid("p", 1)) is not None and s.num_running == 2
    assert [r.seq_id for r in s.abort_group("p")] == [sid("p"), sid("p", 2)]
    assert not s.has_unfinished() and s.kv_cache_manager.num_free_blocks == 63
    assert s.schedule().is_empty and s.abort_group("p") == []


def test_a_request_id_stays_in_use_while_any_of_its_samples_runs() -> None:
    s = sched()
    s.add_request(make("p", 6, max_tokens=5, n=2))
    s.update(s.schedule(), {sid("p"): 1, sid("p", 1): 2})
    s.abort_request(sid("p"))
    with pytest.raises(ValueError, match="in use"):
        s.add_request(make("p", 3))  # sample 1 still runs
    s.abort_request(sid("p", 1))
    s.add_request(make("p", 3))


def test_seeds_and_sample_lists_the_scheduler_hands_out() -> None:
    s = sched()
    p = make("p", 6, max_tokens=3, n=3, seed=40)
    q = make("q", 5, max_tokens=3)
    s.add_request(p)
    s.add_request(q)
    out = s.schedule()
    by_seq = {x.seq_id: x for x in out.scheduled}
    # sample k of a fork seeds with seed + k; an unseeded request stays unseeded
    assert [(x.seq_id, x.seed) for x in by_seq[sid("p")].samples] == [(sid("p", k), 40 + k) for k in range(3)]
    assert [(x.seq_id, x.seed) for x in by_seq[sid("q")].samples] == [(sid("q"), None)]
    assert by_seq[sid("q")].samples[0].output_token_ids is q.output_token_ids  # no copy per step
    s.update(out, {smp.seq_id: 9 for x in out.scheduled for smp in x.samples})
    out = s.schedule()
    # each fork then takes its own sample, seeded as the fork's sample was: the generator carries on
    assert [(x.seq_id, x.samples[0].seed) for x in out.scheduled][:3] == [(sid("p", k), 40 + k) for k in range(3)]
    first = [x.samples for x in out.scheduled]
    s.update(out, {smp.seq_id: 8 for x in out.scheduled for smp in x.samples})
    assert all(a is b for a, b in zip(first, [x.samples for x in s.schedule().scheduled], strict=True))


def test_finished_sequences_reach_the_next_output_that_runs() -> None:
    s = sched()
    a, b = make("a", 3, max_tokens=1), make("b", 3, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s)
    assert out.finished_seq_ids == [] and a.is_finished
    s.finish(EngineFinishes(stopped=[sid("b")]))
    assert s.schedule().is_empty  # nothing to run: the finishes wait for an output that reaches the runner
    s.add_request(make("c", 3))
    out, _ = step(s)
    assert out.finished_seq_ids == [sid("a"), sid("b")]
    assert step(s)[0].finished_seq_ids == []


@pytest.mark.parametrize(
    ("stop", "tokens", "status", "num_out"),
    [
        ({"eos_token_ids": frozenset({2})}, [5, 2, 5], RequestStatus.FINISHED_STOPPED, 2),
        (
            {"eos_token_ids": frozenset({2}), "ignore_eos": True},
            [5, 2, 5, 5],
            RequestStatus.FINISHED_LENGTH,
            4,
        ),
        ({"stop_token_ids": frozenset({3}), "ignore_eos": True}, [3, 5], RequestStatus.FINISHED_STOPPED, 1),
        ({"eos_token_ids": frozenset({2}), "min_tokens": 2}, [2, 2, 2], RequestStatus.FINISHED_STOPPED, 3),
        ({"eos_token_ids": frozenset({2})}, [5, 5, 5, 2], RequestStatus.FINISHED_STOPPED, 4),
    ],
)
def test_stop_conditions(stop: dict[str, Any], tokens: list[int], status: RequestStatus, num_out: int) -> None:
    s = sched()
    r = make("a", 3, max_tokens=4, **stop)
    s.add_request(r)
    for t in tokens:
        if r.is_finished:
            break
        step(s, token=t)
    assert r.status == status and len(r.output_token_ids) == num_out
    assert r.status.finish_reason in ("stop", "length") and s.kv_cache_manager.num_free_blocks == 63


def test_max_model_len_stops_with_length() -> None:
    s = sched(max_model_len=8)
    r = make("a", 6, max_tokens=100)
    s.add_request(r)
    step(s)
    step(s)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 8


def test_abort_waiting_running_and_mid_step() -> None:
    s = sched(max_num_seqs=1)
    a, b = make("a", 5), make("b", 5)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert s.abort_request(sid("b")) is b and b.status == RequestStatus.FINISHED_ABORTED  # waiting
    assert s.abort_request(sid("a")) is a  # running, while its step runs
    assert s.update(out, {sid("a"): 1}) == [] and a.output_token_ids == []
    assert s.abort_request(sid("a")) is None and not s.has_unfinished()
    assert s.kv_cache_manager.num_free_blocks == 63 and s.kv_cache_manager.num_requests == 0


def test_abort_all_after_an_update_that_raised_midway() -> None:
    # a finished its last token inside the update that then raised (b's token missing, as when a
    # Ctrl-C lands mid-step): abort_all must leave no finished sequence queued, or every later
    # schedule() would run it again
    s = sched()
    a, b = make("a", 5, max_tokens=1), make("b", 5, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        s.update(out, {sid("a"): 1})
    s.abort_all()
    assert s.num_running == 0 and not s.has_unfinished()
    c = make("c", 5)
    s.add_request(c)
    out, advanced = step(s)
    assert [x.seq_id for x in out.scheduled] == [sid("c")] and advanced == [c]
    assert s.kv_cache_manager.num_requests == 1


def test_finish_request_from_the_engine() -> None:
    s = sched()
    r = make("a", 5, max_tokens=10)
    s.add_request(r)
    step(s)
    assert s.finish_request(sid("a"), RequestStatus.FINISHED_STOPPED) is r
    assert r.status.finish_reason == "stop" and s.num_running == 0
    with pytest.raises(ValueError):
        s.finish_request(sid("a"), RequestStatus.RUNNING)


def test_engine_finishes_in_one_value_object() -> None:
    s = sched()
    a, b, c = make("a", 5, max_tokens=10), make("b", 5, max_tokens=10, n=2), make("c", 5, max_tokens=10)
    for r in (a, b, c):
        s.add_request(r)
    step(s)
    assert not EngineFinishes() and EngineFinishes(aborted=["x"])
    done = s.finish(EngineFinishes(stopped=[sid("a"), sid("zz")], aborted=["b", "nobody"]))
    assert [r.seq_id for r in done] == [sid("a"), sid("b"), sid("b", 1)]
    assert a.status is RequestStatus.FINISHED_STOPPED and done[1].status is RequestStatus.FINISHED_ABORTED
    assert [r.seq_id for r in s.running] == [sid("c")]


def test_update_protocol_is_enforced() -> None:
    s = sched()
    s.add_request(make("a", 5))
    out = s.schedule()
    with pytest.raises(RuntimeError, match="update"):
        s.schedule()
    with pytest.raises(ValueError, match="no sampled token for sequence 'a'"):
        s.update(out, {sid("a", 1): 1})
    empty = sched().schedule()
    assert empty.is_empty and sched().update(empty, {}) == []


def test_repeated_prompt_hits_the_prefix_cache() -> None:
    s = sched()
    first = make("a", list(range(13)), max_tokens=2)
    s.add_request(first)
    out1, _ = step(s)
    step(s)
    assert first.is_finished
    again = make("b", list(range(13)), max_tokens=2)
    s.add_request(again)
    out2, _ = step(s)
    x = out2.scheduled[0]
    assert x.start_position == 12 and x.token_ids == again.prompt_token_ids[12:]
    assert x.block_ids[:3] == out1.scheduled[0].block_ids[:3]
    assert again.num_cached_prompt_tokens == 12
    assert s.prefix_cache_hit_tokens == 12 and s.prefix_cache_query_tokens == 26


def test_prefix_caching_off_recomputes() -> None:
    s = sched(enable_prefix_caching=False)
    for rid in ("a", "b"):
        r = make(rid, list(range(13)), max_tokens=1)
        s.add_request(r)
        out, _ = step(s)
        assert out.scheduled[0].start_position == 0
    assert s.prefix_cache_hit_tokens == 0


def test_kv_waste_counts_the_unfilled_tails_of_running_requests() -> None:
    s = sched(max_num_batched_tokens=64)
    assert s.kv_slots() == (0, 0) and s.kv_waste == 0.0
    s.add_request(make("a", 5, max_tokens=8))  # 5 tokens in blocks of 4: 2 blocks, 3 slots empty
    s.add_request(make("b", 8, max_tokens=8))  # 8 tokens: 2 full blocks
    step(s)
    assert s.kv_slots() == (16, 13)
    assert s.kv_waste == 3 / 16
