"""The Prometheus registry: the engine snapshot's counters and gauges, speculative decoding's included."""

from __future__ import annotations

from types import SimpleNamespace

from plinth.sched.draft import SpecDecodeStats
from plinth.server.async_engine import AsyncEngine, EngineStats
from plinth.server.metrics import ServerMetrics


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the metrics")


def test_speculative_decoding_counters_and_gauges() -> None:
    stats = EngineStats(spec_num_drafts_total=4, spec_num_draft_tokens_total=16, spec_num_accepted_tokens_total=12)
    text = ServerMetrics(lambda: stats, "m", vllm_names=True).render().decode()
    assert _value(text, "plinth:spec_decode_num_drafts_total") == 4
    assert _value(text, "plinth:spec_decode_num_draft_tokens_total") == 16
    assert _value(text, "plinth:spec_decode_num_accepted_tokens_total") == 12
    assert _value(text, "plinth:spec_decode_acceptance_rate") == 0.75
    assert _value(text, "plinth:spec_decode_accepted_tokens_per_step") == 3.0
    assert _value(text, "vllm:spec_decode_num_accepted_tokens_total") == 12  # vLLM's dashboards


def test_off_reads_zero() -> None:
    text = ServerMetrics(EngineStats, "m").render().decode()
    assert _value(text, "plinth:spec_decode_acceptance_rate") == 0.0
    assert _value(text, "plinth:spec_decode_accepted_tokens_per_step") == 0.0


def test_the_snapshot_reads_the_schedulers_counters() -> None:
    scheduler = SimpleNamespace(
        num_running=1,
        num_waiting=0,
        kv_usage=0.5,
        kv_waste=0.1,
        num_preemptions_total=0,
        prefix_cache_query_tokens=0,
        prefix_cache_hit_tokens=0,
        spec_stats=SpecDecodeStats(3, 12, 7),
    )
    engine = AsyncEngine(SimpleNamespace(scheduler=scheduler))  # type: ignore[arg-type]
    engine._snapshot()
    s = engine.stats
    assert (s.spec_num_drafts_total, s.spec_num_draft_tokens_total, s.spec_num_accepted_tokens_total) == (3, 12, 7)
