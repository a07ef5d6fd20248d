"""Prompt logprobs in the scheduler: chunks name the prompt tokens their rows predict, and a request
that still has its prompt to score takes no prefix-cache hits."""

from __future__ import annotations

from test_scheduler import make, sched, sid, step

from plinth.sched.request import PromptTargets, Request, StopCriteria


def scored(rid: str, prompt: list[int], top: int = 2, n: int = 1) -> Request:
    return Request(rid, list(prompt), StopCriteria(max_tokens=3), params=None, n=n, prompt_logprobs=top)


def test_chunks_carry_the_next_prompt_token_of_each_row_until_the_prompt_ends() -> None:
    s = sched(max_num_batched_tokens=4)
    prompt = list(range(100, 110))
    s.add_request(scored("a", prompt, top=3))
    trace = []
    while s.has_unfinished():
        out, _ = step(s)
        [chunk] = out.scheduled
        trace.append((chunk.start_position, chunk.prompt_targets))
    assert (
        trace[:3]
        == [
            (0, PromptTargets(3, prompt[1:5])),  # row p predicts prompt[p + 1]
            (4, PromptTargets(3, prompt[5:9])),
            (8, PromptTargets(3, prompt[9:10])),  # the last row predicts the first output: no target
        ]
    )
    assert [t for _, t in trace[3:]] == [None, None]  # decodes score nothing


def test_requests_without_prompt_logprobs_and_one_token_prompts_get_no_targets() -> None:
    s = sched()
    s.add_request(make("plain", 6))
    s.add_request(scored("one", [5]))
    out, _ = step(s)
    assert [x.prompt_targets for x in out.scheduled] == [None, None]


def test_no_prefix_hits_while_the_prompt_is_unscored() -> None:
    s = sched()
    prompt = list(range(200, 210))  # 2 full blocks of 4 + 2 tokens
    s.add_request(make("warm", prompt))
    step(s)
    s.add_request(make("plain", prompt))
    s.add_request(scored("scored", prompt))
    out, _ = step(s)
    starts = {x.seq_id.request_id: x.start_position for x in out.scheduled}
    assert starts == {"warm": 10, "plain": 8, "scored": 0}
    assert out.scheduled[2].prompt_targets == PromptTargets(2, prompt[1:])


def test_a_fork_scores_its_prompt_once() -> None:
    s = sched()
    s.add_request(scored("n", list(range(300, 306)), n=3))
    out, _ = step(s)
    assert out.scheduled[0].prompt_targets is not None and out.scheduled[0].num_samples == 3
    out, _ = step(s)
    assert {x.seq_id for x in out.scheduled} == {sid("n", 0), sid("n", 1), sid("n", 2)}
    assert all(x.prompt_targets is None for x in out.scheduled)


def test_a_request_preempted_after_sampling_takes_hits_and_scores_nothing_again() -> None:
    r = scored("p", list(range(400, 409)))
    assert r.computes_whole_prompt
    r.output_token_ids.append(7)  # it sampled: its prompt was scored
    assert not r.computes_whole_prompt and r.prompt_targets(0, 9) is None
