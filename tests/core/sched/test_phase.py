"""Phase policy (``mixed_batches=False``): decode steps and prefill steps, alternating when both are ready."""

from __future__ import annotations

from typing import Any

from plinth.sched.output import SchedulerOutput
from plinth.sched.phase import AlternatingPhases, MixedBatches
from plinth.sched.request import Request, RequestStatus, SequenceId, StopCriteria
from plinth.sched.scheduler import Scheduler


def make(rid: str, prompt: list[int] | int, max_tokens: int = 4) -> Request:
    base = 1000 * sum(map(ord, rid))  # an int prompt gets tokens of its own: no accidental prefix hits
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else list(prompt)
    return Request(request_id=rid, prompt_token_ids=tokens, stop=StopCriteria(max_tokens), params=None)


def sched(**kw: Any) -> Scheduler:
    args: dict[str, Any] = dict(
        num_blocks=64, block_size=4, max_num_batched_tokens=8, max_num_seqs=8, max_model_len=64, mixed_batches=False
    )
    args.update(kw)
    return Scheduler(**args)


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, {smp.seq_id: token for x in out.scheduled for smp in x.samples})
    return out


def chunks(out: SchedulerOutput) -> dict[str, tuple[int, int]]:
    """request id -> (start, num tokens)."""
    return {x.seq_id.request_id: (x.start_position, len(x.token_ids)) for x in out.scheduled}


def test_phases_alternate_when_decode_and_prefill_work_are_both_ready() -> None:
    s = sched()
    a, b, c = make("a", 6), make("b", 6), make("c", 6)
    s.add_request(a)
    assert chunks(step(s)) == {"a": (0, 6)} and s.last_phase == "prefill"
    s.add_request(b)
    s.add_request(c)
    # a decodes, b and c wait: the previous step was a prefill, so this one decodes and admits nobody
    assert chunks(step(s)) == {"a": (6, 1)} and s.last_phase == "decode" and s.num_waiting == 2
    # a has decode work again, but now prefill's turn: a is skipped (not preempted), b and c admitted
    assert chunks(step(s)) == {"b": (0, 6), "c": (0, 2)} and s.last_phase == "prefill"
    assert a.status == RequestStatus.RUNNING and a.num_computed_tokens == 7
    assert chunks(step(s)) == {"a": (7, 1), "b": (6, 1)} and s.last_phase == "decode"
    assert chunks(step(s)) == {"c": (2, 4)} and s.last_phase == "prefill"
    # only decode work left: decode steps back to back
    assert chunks(step(s)) == {"a": (8, 1), "b": (7, 1), "c": (6, 1)} and s.last_phase == "decode"
    assert chunks(step(s)) == {"b": (8, 1), "c": (7, 1)} and a.is_finished and b.is_finished
    assert chunks(step(s)) == {"c": (8, 1)} and s.last_phase == "decode"
    assert not s.has_unfinished() and s.schedule().is_empty and s.last_phase is None


def test_the_same_steps_mix_when_mixed_batches_are_allowed() -> None:
    s = sched(mixed_batches=True)
    a, b, c = make("a", 6), make("b", 6), make("c", 6)
    s.add_request(a)
    step(s)
    s.add_request(b)
    s.add_request(c)
    assert chunks(step(s)) == {"a": (6, 1), "b": (0, 6), "c": (0, 1)} and s.last_phase is None
    assert chunks(step(s)) == {"a": (7, 1), "b": (6, 1), "c": (1, 5)} and s.last_phase is None
    assert isinstance(s._phases, MixedBatches) and isinstance(sched()._phases, AlternatingPhases)


def test_prefill_only_steps_run_chunked_prompts_back_to_back() -> None:
    s = sched(max_num_batched_tokens=6)
    for rid in "ab":
        s.add_request(make(rid, 9))
    assert chunks(step(s)) == {"a": (0, 6)} and s.last_phase == "prefill"
    assert chunks(step(s)) == {"a": (6, 3), "b": (0, 3)} and s.last_phase == "prefill"
    # now a decodes and b still has prefill work: the phases alternate again
    assert chunks(step(s)) == {"a": (9, 1)} and s.last_phase == "decode"
    assert chunks(step(s)) == {"b": (3, 6)} and s.last_phase == "prefill"


def test_a_prefill_turn_that_cannot_admit_hands_the_step_to_the_decodes() -> None:
    s = sched(max_num_seqs=2)
    a, b, c = make("a", 3, max_tokens=8), make("b", 3, max_tokens=8), make("c", 3)
    s.add_request(a)
    s.add_request(b)
    assert chunks(step(s)) == {"a": (0, 3), "b": (0, 3)}
    s.add_request(c)  # c is prefill work, but both seats are taken
    assert chunks(step(s)) == {"a": (3, 1), "b": (3, 1)} and s.last_phase == "decode"
    # prefill's turn: c still cannot get a seat, so the decodes run instead of an empty step
    out = step(s)
    assert chunks(out) == {"a": (4, 1), "b": (4, 1)} and s.last_phase == "decode" and s.num_waiting == 1


def test_a_decode_step_preempts_prefill_work_at_the_tail() -> None:
    # 2 usable blocks of 4 tokens: a and b take one each, then a needs a second one
    s = sched(num_blocks=3, max_model_len=8)
    a, b = make("a", 4), make("b", 7)
    s.add_request(a)
    s.add_request(b)
    assert chunks(step(s)) == {"a": (0, 4), "b": (0, 4)}
    out = step(s)  # a decodes at position 4: b (prefill work) is the running tail, so it is the victim
    assert chunks(out) == {"a": (4, 1)} and out.preempted_ids == [SequenceId("b", 0)]
    assert s.last_phase == "decode" and b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    while s.has_unfinished():
        step(s)
    assert b.output_token_ids == [7] and a.output_token_ids == [7] * 4


def test_a_phase_whose_only_candidate_preempts_itself_returns_an_empty_step() -> None:
    s = sched(num_blocks=5, max_model_len=16, enable_prefix_caching=False)
    a, b = make("a", 4), make("b", 12, max_tokens=1)
    s.add_request(a)
    s.add_request(b)
    assert chunks(step(s)) == {"a": (0, 4), "b": (0, 4)}
    assert chunks(step(s)) == {"a": (4, 1)}  # a's second block; 1 free block left
    out = step(s)  # prefill: b needs 2 more blocks, only 1 free, and b is the tail: it preempts itself
    assert out.is_empty and out.preempted_ids == [SequenceId("b", 0)] and s.last_phase is None
    out = step(s)  # the empty step did not count: prefill's turn again, b re-admitted from token 0
    assert chunks(out) == {"b": (0, 8)} and s.last_phase == "prefill"


def test_a_prefix_hit_leaving_one_token_is_admitted_in_a_prefill_step() -> None:
    s = sched()
    prompt = list(range(100, 105))  # one full block and one token
    first = make("a", prompt, max_tokens=1)
    s.add_request(first)
    step(s)
    assert first.is_finished
    s.add_request(make("b", prompt, max_tokens=1))
    out = step(s)
    assert chunks(out) == {"b": (4, 1)} and s.last_phase == "prefill"
    assert out.scheduled[0].block_ids[0] == 1  # the hit
