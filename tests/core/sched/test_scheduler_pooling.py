"""Embedding requests in the scheduler: Pool chunks instead of samples, prompt-only blocks, finished
in update() once the prompt is computed; mean pooling never takes prefix hits."""

from __future__ import annotations

import pytest
from test_scheduler import make, sched, sid, step

from plinth.sched.output import EngineFinishes
from plinth.sched.request import Pool, Pooling, Request, RequestStatus, StopCriteria


def embed(rid: str, prompt: list[int] | int, pooling: Pooling = Pooling.LAST) -> Request:
    base = 1000 * sum(map(ord, rid))
    tokens = list(range(base, base + prompt)) if isinstance(prompt, int) else list(prompt)
    return Request(rid, tokens, StopCriteria(max_tokens=0), params=None, pooling=pooling)


def test_chunks_pool_instead_of_sampling_and_the_request_finishes_after_its_prompt() -> None:
    s = sched(max_num_batched_tokens=8)
    e = embed("e", 20, Pooling.MEAN)
    s.add_request(e)
    pools = []
    while s.has_unfinished():
        out, changed = step(s)
        [chunk] = out.scheduled
        assert chunk.samples == () and chunk.pool is not None
        pools.append((chunk.start_position, len(chunk.token_ids), chunk.pool))
        assert changed == ([e] if chunk.pool.final else [])
    assert pools == [
        (0, 8, Pool(Pooling.MEAN, False)),
        (8, 8, Pool(Pooling.MEAN, False)),
        (16, 4, Pool(Pooling.MEAN, True)),
    ]
    assert e.status is RequestStatus.FINISHED_STOPPED and e.output_token_ids == []
    assert s.kv_usage == 0.0 and s.kv_cache_manager.num_requests == 0


def test_an_embedding_holds_only_its_prompt_blocks_and_may_fill_the_context() -> None:
    s = sched(max_model_len=16, max_num_batched_tokens=32)  # blocks of 4
    s.add_request(embed("e", 16))  # a generation prompt of 16 would leave no room
    out = s.schedule()
    assert len(out.scheduled[0].block_ids) == 4
    s.update(out, {})
    assert not s.has_unfinished()
    with pytest.raises(ValueError, match="at most max_model_len=16"):
        s.add_request(embed("f", 17))


def test_batched_with_generation_whose_tokens_it_does_not_touch() -> None:
    s = sched()
    g = make("g", 5, max_tokens=3)
    s.add_request(g)
    s.add_request(embed("e", 6))
    out, changed = step(s)
    assert {x.seq_id.request_id: x.num_samples for x in out.scheduled} == {"g": 1, "e": 0}
    assert [r.request_id for r in changed] == ["g", "e"] and g.output_token_ids == [7]
    while s.has_unfinished():
        step(s)
    assert g.output_token_ids == [7, 7, 7]


def test_last_pooling_takes_prefix_hits_mean_pooling_does_not() -> None:
    s = sched()
    prompt = list(range(100, 110))  # 2 full blocks of 4 + 2 tokens
    s.add_request(embed("a", prompt))
    step(s)
    s.add_request(embed("last", prompt))
    s.add_request(embed("mean", prompt, Pooling.MEAN))
    out, _ = step(s)
    starts = {x.seq_id.request_id: x.start_position for x in out.scheduled}
    assert starts == {"last": 8, "mean": 0}


def test_a_preempted_mean_pooled_embedding_recomputes_from_position_0() -> None:
    # 4 usable blocks of 4: the decoding request's growth preempts the embedding (the latest admitted)
    s = sched(num_blocks=5, block_size=4, max_model_len=16, max_num_batched_tokens=4)
    g = make("g", 4, max_tokens=8)
    s.add_request(g)
    step(s)
    e = embed("e", 12, Pooling.MEAN)
    s.add_request(e)
    trace = []
    while s.has_unfinished():
        out, _ = step(s)
        trace += [(x.start_position, x.pool) for x in out.scheduled if x.seq_id == sid("e")]
        if out.preempted_ids:
            assert out.preempted_ids == [sid("e")]
            trace.append("preempted")
    assert e.num_preemptions > 0 and trace.count("preempted") == e.num_preemptions
    after = [trace[i + 1][0] for i, t in enumerate(trace) if t == "preempted"]  # type: ignore[index]
    assert after == [0] * e.num_preemptions  # no prefix hits: the pooler sees every token again
    assert trace[-1] == (8, Pool(Pooling.MEAN, True)) and e.status is RequestStatus.FINISHED_STOPPED
    assert len(g.output_token_ids) == 8 and s.kv_usage == 0.0


def test_an_aborted_embedding_frees_its_blocks() -> None:
    s = sched()
    s.add_request(embed("x", 30))
    out = s.schedule()
    assert out.scheduled[0].pool == Pool(Pooling.LAST, False)
    s.finish(EngineFinishes(aborted=["x"]))
    s.update(out, {})
    assert s.kv_usage == 0.0 and not s.has_unfinished()
    assert s.schedule().is_empty
