"""Property tests: random workloads against a fake model that reads its context back from a fake KV cache.

The fake model keeps one ``(position, token)`` entry per KV slot. A step first writes every scheduled
token into the slot its block table names (after applying the copy-on-write pairs), then, for each
request that samples, reads its whole context back through its block table and returns a token that
is a pure function of that context. So any bookkeeping bug (a wrong position, a stale or shared block
overwritten, a bad prefix hit, a lost copy) changes some output, and every output can be checked
against a reference that runs each request alone with no scheduler at all.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plinth.sched.output import SchedulerOutput
from plinth.sched.request import Request, RequestStatus, SequenceId, StopCriteria
from plinth.sched.scheduler import Scheduler

VOCAB = 12
EOS = 0
STOP_TOKEN = 1


def next_token(context: list[int], sample_index: int) -> int:
    """The fake model: a pure function of the context (and of the sample index at a fork)."""
    return hash((tuple(context), sample_index)) % VOCAB


class FakeModel:
    """A runner stand-in with a KV cache of ``(position, token)`` slots."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.bs = sched.block_size
        self.kv: list[list[tuple[int, int] | None]] = [
            [None] * self.bs for _ in range(sched.kv_cache_manager.pool.num_blocks)
        ]

    def step(self, out: SchedulerOutput) -> dict[SequenceId, int]:
        pool = self.sched.kv_cache_manager.pool
        for src, dst in out.block_copies:  # before the step, in order
            self.kv[dst] = list(self.kv[src])
        written: set[tuple[int, int]] = set()
        for s in out.scheduled:
            for k, token in enumerate(s.token_ids):
                pos = s.start_position + k
                block = s.block_ids[pos // self.bs]
                assert block != 0, "wrote into the null block"
                assert pool.block(block).ref_cnt == 1, f"wrote into shared block {block}"
                assert pool.block(block).block_hash is None, f"wrote into cached block {block}"
                slot = (block, pos % self.bs)
                assert slot not in written, f"slot {slot} written twice in one step"
                written.add(slot)
                self.kv[block][pos % self.bs] = (pos, token)
        sampled: dict[SequenceId, int] = {}
        for s in out.scheduled:
            if s.num_samples == 0:
                continue
            end = s.start_position + len(s.token_ids)
            context = []
            for pos in range(end):
                entry = self.kv[s.block_ids[pos // self.bs]][pos % self.bs]
                assert entry is not None and entry[0] == pos, f"slot for position {pos} holds {entry}"
                context.append(entry[1])
            for i, sample in enumerate(s.samples):
                sampled[sample.seq_id] = next_token(context, i)
        return sampled


def reference_status(prompt: list[int], out: list[int], stop: StopCriteria, max_model_len: int) -> RequestStatus | None:
    if len(out) > stop.min_tokens and (
        out[-1] in stop.stop_token_ids or (not stop.ignore_eos and out[-1] in stop.eos_token_ids)
    ):
        return RequestStatus.FINISHED_STOPPED
    if len(out) >= stop.max_tokens or len(prompt) + len(out) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def reference(
    prompt: list[int], n: int, stop: StopCriteria, max_model_len: int
) -> list[tuple[list[int], RequestStatus]]:
    """Each sample's outputs and finish status, computed with no scheduler."""
    results = []
    for i in range(n):
        out = [next_token(prompt, i)]
        while (status := reference_status(prompt, out, stop, max_model_len)) is None:
            out.append(next_token(prompt + out, 0))
        results.append((out, status))
    return results


def check_state(s: Scheduler, after_update: bool) -> None:
    """Invariants that hold between steps."""
    kv = s.kv_cache_manager
    pool = kv.pool
    tables = kv.tables()
    assert set(tables) == {r.seq_id for r in s.running}
    counts = [0] * pool.num_blocks
    for table in tables.values():
        assert len(set(table)) == len(table) and 0 not in table
        for b in table:
            counts[b] += 1
    for b in range(1, pool.num_blocks):
        assert pool.block(b).ref_cnt == counts[b], f"block {b}: ref {pool.block(b).ref_cnt} != {counts[b]}"
        h = pool.block(b).block_hash
        assert h is None or pool.lookup(h) is pool.block(b)
    free = pool.free_block_ids()
    assert sorted(free) == [b for b in range(1, pool.num_blocks) if counts[b] == 0]
    assert pool.block(0).ref_cnt == 0 and 0 not in free
    assert sum(s._seats(r) for r in s.running) <= s.max_num_seqs
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and r.num_computed_tokens == 0
    for r in s.running:
        assert r.status == RequestStatus.RUNNING
        assert len(tables[r.seq_id]) * s.block_size >= r.num_computed_tokens
        assert r.num_tokens <= s.max_model_len
        if after_update:
            assert r.num_computed_tokens < r.num_tokens
    assert s.num_running + s.num_waiting == len(s._requests)


def check_output(s: Scheduler, out: SchedulerOutput) -> None:
    """Invariants of one step's output."""
    assert out.num_batched_tokens == sum(len(x.token_ids) for x in out.scheduled)
    assert out.num_batched_tokens <= s.max_num_batched_tokens
    assert len(out.scheduled) <= s.max_num_seqs
    assert len({x.seq_id for x in out.scheduled}) == len(out.scheduled)
    for x in out.scheduled:
        r = s.get_request(x.seq_id)
        assert r is not None and r.seq_id == x.seq_id
        end = x.start_position + len(x.token_ids)
        assert x.token_ids and x.token_ids == r.all_token_ids[x.start_position : end]
        assert r.num_computed_tokens == end  # advanced in schedule()
        assert len(x.block_ids) * s.block_size >= end
        assert x.block_ids == s.kv_cache_manager.block_ids(r.seq_id)
        if s.long_prefill_token_threshold:
            assert len(x.token_ids) <= s.long_prefill_token_threshold
        assert (x.num_samples > 0) == (end == r.num_tokens)
        assert x.num_samples <= 1 or (x.num_samples == r.n and not r.forked)
        if x.num_samples > 1:  # a fork names its new sequences
            assert [y.seq_id for y in x.samples] == [SequenceId(r.request_id, k) for k in range(r.n)]
        elif x.samples:
            assert x.samples[0].seq_id == x.seq_id


@dataclass
class Arrival:
    step: int
    request: Request
    abort_at: int | None
    abort_mid_step: bool
    abort_group: bool


class PhaseLog:
    """Checks the phase policy on every step and counts what happened."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.previous: str | None = None  # the phase of the last non-empty step
        self.steps = {"decode": 0, "prefill": 0, "mixed": 0, "empty": 0}
        self.both_ready = 0  # steps that started with decode and prefill work both ready
        self.remaining: dict[SequenceId, int] = {}
        self.ready_both = False

    def before(self) -> None:
        """Snapshot each running request's tokens left (the work kind), before ``schedule()``."""
        s = self.s
        self.remaining = {r.seq_id: r.num_tokens - r.num_computed_tokens for r in s.running}
        decode = any(v == 1 for v in self.remaining.values())
        self.ready_both = decode and (bool(s.waiting) or any(v > 1 for v in self.remaining.values()))
        self.both_ready += self.ready_both

    def after(self, out: SchedulerOutput) -> None:
        """The step's chunks are all of one kind (when phased), and the phases alternate."""
        s = self.s
        decodes = [x for x in out.scheduled if self.remaining.get(x.seq_id) == 1]
        prefills = [x for x in out.scheduled if self.remaining.get(x.seq_id) != 1]
        assert all(len(x.token_ids) == 1 for x in decodes)
        if not out.scheduled:
            self.steps["empty"] += 1
            assert s.last_phase is None
            return
        if s.mixed_batches:
            assert s.last_phase is None
            self.steps["mixed" if decodes and prefills else "prefill" if prefills else "decode"] += 1
            return
        assert not (decodes and prefills), f"a phased step mixed {len(decodes)} decodes with {len(prefills)} prefills"
        phase = "decode" if decodes else "prefill"
        assert s.last_phase == phase
        if self.ready_both and self.previous == "prefill":
            assert phase == "decode", "two prefill steps in a row while decodes were ready"
        self.previous = phase
        self.steps[phase] += 1


def run(
    s: Scheduler, arrivals: list[Arrival], max_steps: int = 3000, phases: PhaseLog | None = None
) -> dict[SequenceId, Request]:
    """Drive the scheduler with the fake model until every request is finished or aborted."""
    model = FakeModel(s)
    phases = phases or PhaseLog(s)
    seen: dict[SequenceId, Request] = {}
    pending = sorted(arrivals, key=lambda a: a.step)
    step = 0

    def aborts(mid: bool) -> None:
        for a in arrivals:
            if a.abort_at == step and a.abort_mid_step == mid and a.request.seq_id in seen:
                if a.abort_group:
                    s.abort_group(a.request.request_id)
                else:
                    s.abort_request(a.request.seq_id)

    while pending or s.has_unfinished():
        while pending and pending[0].step <= step:
            r = pending.pop(0).request
            s.add_request(r)
            seen[r.seq_id] = r
        aborts(mid=False)
        phases.before()
        out = s.schedule()
        phases.after(out)
        check_output(s, out)
        check_state(s, after_update=False)
        # a phased step may come back empty when its only candidate preempted itself
        stall_ok = not s.mixed_batches and bool(out.preempted_ids)
        assert not out.is_empty or stall_ok or not s.has_unfinished(), "stalled with unfinished requests"
        sampled = model.step(out)
        aborts(mid=True)
        changed = s.update(out, sampled)
        for r in changed:
            seen.setdefault(r.seq_id, r)
            assert r.output_token_ids
        check_state(s, after_update=True)
        step += 1
        assert step < max_steps, "requests did not finish in bounded steps"
    return seen


def check_results(s: Scheduler, arrivals: list[Arrival], seen: dict[SequenceId, Request]) -> None:
    """No leaks, and every output equals (or, when aborted, is a prefix of) the reference."""
    kv = s.kv_cache_manager
    assert kv.num_requests == 0 and kv.num_free_blocks == kv.pool.num_usable_blocks
    assert all(kv.pool.block(b).ref_cnt == 0 for b in range(kv.pool.num_blocks))
    assert getattr(kv._prefix, "num_tracked_requests", 0) == 0
    assert not s.waiting and not s.running
    for a in arrivals:
        r = a.request
        ref = reference(r.prompt_token_ids, r.n, r.stop, s.max_model_len)
        for i, (expected, status) in enumerate(ref):
            got = seen.get(SequenceId(r.request_id, i))
            if got is None:  # aborted before it forked
                assert r.status == RequestStatus.FINISHED_ABORTED
                continue
            assert got.is_finished
            if got.status == RequestStatus.FINISHED_ABORTED:
                assert expected[: len(got.output_token_ids)] == got.output_token_ids
            else:
                assert (got.output_token_ids, got.status) == (expected, status), got.seq_id


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict[str, int | bool], list[Arrival]]:
    bs = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(6, 20))
    min_blocks = -(-max_model_len // bs) + 1
    num_blocks = draw(st.integers(min_blocks, min_blocks + 6 // bs))  # small pools: preemption
    chunked = draw(st.booleans())
    budget = draw(st.integers(1 if chunked else max_model_len, 2 * max_model_len))
    max_num_seqs = draw(st.integers(1, 6))
    config: dict[str, int | bool] = dict(
        num_blocks=num_blocks,
        block_size=bs,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3])) if chunked else 0,
    )
    tokens = st.integers(2, VOCAB - 1)
    bases = draw(st.lists(st.lists(tokens, max_size=12), min_size=1, max_size=3))
    arrivals = []
    for i in range(draw(st.integers(1, 8))):
        base = draw(st.sampled_from(bases))
        prompt = base[: draw(st.integers(0, len(base)))] + draw(st.lists(tokens, max_size=5))
        prompt = (prompt or [2])[: max_model_len - 1]
        stop = StopCriteria(
            max_tokens=draw(st.integers(1, 12)),
            eos_token_ids=frozenset({EOS}),
            stop_token_ids=draw(st.sampled_from([frozenset(), frozenset({STOP_TOKEN})])),
            ignore_eos=draw(st.booleans()),
            min_tokens=draw(st.integers(0, 2)),
        )
        n = draw(st.integers(1, min(3, max_num_seqs)))
        request = Request(request_id=f"r{i}", prompt_token_ids=prompt, stop=stop, params=None, n=n)
        arrive = draw(st.integers(0, 6))
        abort_at = draw(st.one_of(st.none(), st.none(), st.integers(arrive, arrive + 10)))
        arrivals.append(Arrival(arrive, request, abort_at, draw(st.booleans()), draw(st.booleans())))
    return config, arrivals


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants_and_match_the_reference(
    work: tuple[dict[str, int | bool], list[Arrival]],
) -> None:
    config, arrivals = work
    s = Scheduler(**config)  # type: ignore[arg-type]
    seen = run(s, arrivals)
    check_results(s, arrivals, seen)


def fixed_requests() -> list[Arrival]:
    shared = [5, 6, 7, 8, 9, 10, 11, 2, 3]
    prompts = [shared, shared + [4], shared[:5] + [3, 3], [7] * 11, shared, [9, 8, 7]]
    out = []
    for i, p in enumerate(prompts):
        stop = StopCriteria(max_tokens=10, eos_token_ids=frozenset({EOS}), ignore_eos=i % 2 == 1)
        request = Request(f"d{i}", list(p), stop, params=None, n=1 + (i == 1) * 2)
        out.append(Arrival(i // 2, request, None, False, False))
    return out


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "budget", "max_num_seqs", "threshold", "caching"),
    [
        (200, 4, 256, 16, 0, True),  # everything at once
        (200, 4, 1, 16, 0, True),  # one token per step
        (200, 2, 5, 3, 0, False),  # odd chunks, few seats
        (13, 2, 7, 8, 3, True),  # a tiny pool: preemption
        (25, 1, 9, 4, 2, True),
        (9, 4, 32, 8, 0, False),
    ],
)
def test_outputs_do_not_depend_on_batching_chunking_or_preemption(
    num_blocks: int, block_size: int, budget: int, max_num_seqs: int, threshold: int, caching: bool
) -> None:
    s = Scheduler(num_blocks, block_size, budget, max_num_seqs, 24, caching, True, threshold)
    arrivals = fixed_requests()
    seen = run(s, arrivals)
    check_results(s, arrivals, seen)
    assert all(r.request_id != "d1" or r.output_token_ids for r in seen.values())
    assert {sid for sid in seen if sid.request_id == "d1"} == {SequenceId("d1", k) for k in range(3)}
    if num_blocks < 20:
        assert s.num_preemptions_total > 0


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 50), min_size=1, max_size=30),
    bs=st.sampled_from([1, 2, 3, 4, 8]),
)
def test_repeated_prompt_reuses_the_cached_blocks(prompt: list[int], bs: int) -> None:
    s = Scheduler(num_blocks=50, block_size=bs, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=40)
    first = Request("a", list(prompt), StopCriteria(max_tokens=2), params=None)
    s.add_request(first)
    out = s.schedule()
    first_table = out.scheduled[0].block_ids
    s.update(out, {first.seq_id: 1})
    s.update(s.schedule(), {first.seq_id: 2})
    assert first.is_finished
    again = Request("b", list(prompt), StopCriteria(max_tokens=1), params=None)
    s.add_request(again)
    out = s.schedule()
    x = out.scheduled[0]
    expected_hit = (len(prompt) - 1) // bs * bs  # full blocks, leaving the last token to compute
    assert x.start_position == expected_hit == again.num_cached_prompt_tokens
    assert x.block_ids[: expected_hit // bs] == first_table[: expected_hit // bs]
    assert x.num_samples == 1


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.booleans(), st.sampled_from(["any", "contiguous"]))
def test_random_workloads_with_phases_and_placements_match_the_reference(
    work: tuple[dict[str, int | bool], list[Arrival]], mixed: bool, placement: str
) -> None:
    config, arrivals = work
    s = Scheduler(**config, mixed_batches=mixed, block_placement=placement)  # type: ignore[arg-type]
    seen = run(s, arrivals)
    check_results(s, arrivals, seen)


def forty_requests(seed: int) -> list[Arrival]:
    """~40 requests arriving over time: random prompt lengths, half of them sharing a prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(2, VOCAB) for _ in range(10)]
    out = []
    for i in range(40):
        own = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 14))]
        prompt = (shared[: rng.randrange(2, 11)] + own if rng.random() < 0.5 else own)[:23]
        stop = StopCriteria(max_tokens=rng.randrange(1, 9), eos_token_ids=frozenset({EOS}), ignore_eos=True)
        out.append(Arrival(rng.randrange(0, 30), Request(f"w{i}", prompt, stop, params=None), None, False, False))
    return out


@pytest.mark.parametrize("placement", ["any", "contiguous"])
@pytest.mark.parametrize("seed", range(4))
def test_phased_batches_never_mix_and_every_request_finishes(seed: int, placement: str) -> None:
    # 20 usable blocks of 2 tokens, max_model_len 32: a few long requests fill the pool (preemption)
    s = Scheduler(21, 2, 8, 6, 32, long_prefill_token_threshold=5, mixed_batches=False, block_placement=placement)
    arrivals = forty_requests(seed)
    log = PhaseLog(s)
    seen = run(s, arrivals, phases=log)
    check_results(s, arrivals, seen)  # every request finished with the reference's tokens
    assert all(a.request.status == RequestStatus.FINISHED_LENGTH for a in arrivals)
    assert s.num_preemptions_total > 0 and s.prefix_cache_hit_tokens > 0
    assert log.steps["mixed"] == 0 and log.steps["decode"] > 0 and log.steps["prefill"] > 0
    assert log.both_ready > 10  # the alternation was exercised, not just one kind at a time


@pytest.mark.parametrize("seed", range(2))
def test_the_same_workload_mixes_when_mixed_batches_are_allowed(seed: int) -> None:
    s = Scheduler(21, 2, 8, 6, 32, long_prefill_token_threshold=5)
    arrivals = forty_requests(seed)
    log = PhaseLog(s)
    check_results(s, arrivals, run(s, arrivals, phases=log))
    assert log.steps["mixed"] > 0  # so the phased test above could have caught a mix


def test_contiguous_placement_keeps_block_ids_dense() -> None:
    # without prefix hits, every block handed out is the lowest free one: no id in use ever exceeds
    # the most blocks in use at once
    def peak_id_and_use(placement: str) -> tuple[int, int]:
        s = Scheduler(41, 2, 8, 6, 32, enable_prefix_caching=False, block_placement=placement)
        arrivals = forty_requests(7)
        model = FakeModel(s)
        pending = sorted(arrivals, key=lambda a: a.step)
        peak_id = peak_use = step = 0
        while pending or s.has_unfinished():
            while pending and pending[0].step <= step:
                s.add_request(pending.pop(0).request)
            out = s.schedule()
            in_use = {b for t in s.kv_cache_manager.tables().values() for b in t}
            peak_id, peak_use = max(peak_id, max(in_use, default=0)), max(peak_use, len(in_use))
            s.update(out, model.step(out))
            step += 1
        return peak_id, peak_use

    peak_id, peak_use = peak_id_and_use("contiguous")
    assert peak_id == peak_use
    any_id, any_use = peak_id_and_use("any")
    assert any_id > any_use  # LRU order wanders over the pool: the check above can fail
