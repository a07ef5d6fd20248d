"""Prometheus metrics, named like vLLM's with the ``plinth:`` prefix, in a registry of their own.

Scheduler state (running, waiting, KV usage, preemptions, prefix-cache tokens) is read at scrape
time from the engine thread's latest :class:`EngineStats` snapshot; per-request measures (tokens,
time to first token, inter-token latency, end-to-end latency, finish reasons) are observed on the
event loop as outputs arrive, through one :class:`RequestTracker` per engine request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from plinth.runtime.outputs import RequestOutput
from plinth.server.async_engine import EngineStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
#: the routes counted by name in http_requests_total; any other path is "other" (bounded label values)
HTTP_HANDLERS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
        "/version",
    }
)


class _EngineCollector(Collector):
    """Gauges and counters read from the engine thread's snapshot at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], labels: dict[str, str]) -> None:
        self._stats = stats
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        names, values = list(self._labels), list(self._labels.values())

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("plinth:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("plinth:num_requests_waiting", "Requests queued, not yet running.", s.num_waiting)
        yield gauge("plinth:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = 100%).", s.kv_usage)
        waste_doc = "Fraction of the running requests' KV slots holding no token (1 = 100%)."
        yield gauge("plinth:kv_cache_waste_perc", waste_doc, s.kv_waste)
        yield counter("plinth:num_preemptions", "Preemptions (recompute) since start.", s.num_preemptions_total)
        queries = s.prefix_cache_queries_total
        yield counter("plinth:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield counter("plinth:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits_total)
        yield counter("plinth:engine_step_failures", "Engine steps that raised.", s.num_failed_steps_total)
        restarts_doc = "Engines rebuilt after a worker failed (--restart-workers)."
        yield counter("plinth:engine_restarts", restarts_doc, s.num_restarts_total)
        # speculative decoding (vLLM's names); zeros while it is off
        drafts, proposed = s.spec_num_drafts_total, s.spec_num_draft_tokens_total
        accepted = s.spec_num_accepted_tokens_total
        yield counter("plinth:spec_decode_num_drafts", "Sequence-steps that carried draft tokens.", drafts)
        yield counter("plinth:spec_decode_num_draft_tokens", "Draft tokens proposed.", proposed)
        yield counter("plinth:spec_decode_num_accepted_tokens", "Draft tokens accepted.", accepted)
        rate_doc = "Accepted over proposed draft tokens since start (0 before any)."
        yield gauge("plinth:spec_decode_acceptance_rate", rate_doc, accepted / proposed if proposed else 0.0)
        per_step_doc = "Draft tokens accepted per sequence-step with drafts, since start (each also samples one token)."
        yield gauge("plinth:spec_decode_accepted_tokens_per_step", per_step_doc, accepted / drafts if drafts else 0.0)


class ServerMetrics:
    """The server's Prometheus registry.

    :param stats: returns the latest engine snapshot (called at scrape time).
    :param model_name: the ``model_name`` label of every metric.
    :param vllm_names: export every metric a second time under vLLM's ``vllm:`` prefix, so a
        dashboard built for vLLM works unchanged.
    """

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, vllm_names: bool = False) -> None:
        self.vllm_names = vllm_names
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.registry.register(_EngineCollector(stats, labels))
        reg, names = self.registry, ["model_name"]
        self.prompt_tokens = Counter("plinth:prompt_tokens", "Prompt tokens processed.", names, registry=reg)
        self.generation_tokens = Counter("plinth:generation_tokens", "Tokens generated.", names, registry=reg)
        self.request_success = Counter(
            "plinth:request_success", "Completions finished, by reason.", [*names, "finished_reason"], registry=reg
        )

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"plinth:{name}", doc, names, buckets=buckets, registry=reg)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.", _E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to the first scheduled step.", _E2E_BUCKETS)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled step to the first token.", _E2E_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled step to finish.", _E2E_BUCKETS
        )
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )
        # unprefixed, like the one vLLM's server exports (prometheus-fastapi-instrumentator's name)
        self.http_requests = Counter(
            "http_requests", "HTTP requests by route, method and status class.", ["handler", "method", "status"],
            registry=reg,
        )  # fmt: skip
        self._label = model_name

    def count_http(self, path: str, method: str, status: int) -> None:
        """Count one answered HTTP request."""
        handler = path if path in HTTP_HANDLERS or path.startswith("/v1/models/") else "other"
        if handler.startswith("/v1/models/"):
            handler = "/v1/models/{model_id}"
        self.http_requests.labels(handler, method, f"{status // 100}xx").inc()

    def tracker(self) -> RequestTracker:
        """A tracker for one engine request."""
        return RequestTracker(self)

    def render(self) -> bytes:
        """The registry in the Prometheus text format (then again as ``vllm:`` when asked)."""
        text = generate_latest(self.registry)
        return text + text.replace(b"plinth:", b"vllm:") if self.vllm_names else text


class RequestTracker:
    """Turns one request's successive outputs into metric observations."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._num_tokens = 0
        self._last_time: float | None = None
        self._started = False
        self._closed = False

    def observe(self, out: RequestOutput) -> None:
        """Count what ``out`` adds over the previous output of the same request."""
        m, label = self._m, self._m._label
        metrics = out.metrics
        if not self._started:
            self._started = True
            m.prompt_tokens.labels(label).inc(metrics.num_prompt_tokens)
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        new = num_tokens - self._num_tokens
        if new > 0:
            m.generation_tokens.labels(label).inc(new)
            now = metrics.last_token_time
            if self._num_tokens == 0 and metrics.time_to_first_token is not None:
                m.ttft.labels(label).observe(metrics.time_to_first_token)
            elif now is not None and self._last_time is not None:
                m.itl.labels(label).observe(now - self._last_time)
            self._num_tokens, self._last_time = num_tokens, now
        if out.finished:
            self._closed = True
            for c in out.outputs:
                m.request_success.labels(label, c.finish_reason or "abort").inc()
            end = metrics.finished_time or time.monotonic()
            m.e2e.labels(label).observe(end - metrics.arrival_time)
            if metrics.first_token_time is not None:
                m.decode_time.labels(label).observe(end - metrics.first_token_time)
            scheduled = metrics.first_scheduled_time
            if scheduled is not None:
                m.queue_time.labels(label).observe(scheduled - metrics.arrival_time)
                m.inference_time.labels(label).observe(end - scheduled)
                if metrics.first_token_time is not None:
                    m.prefill_time.labels(label).observe(metrics.first_token_time - scheduled)
            m.request_prompt_tokens.labels(label).observe(metrics.num_prompt_tokens)
            m.request_generation_tokens.labels(label).observe(num_tokens)

    def close(self) -> None:
        """The request ended: one that started but did not finish counts as aborted."""
        if self._started and not self._closed:
            self._closed = True
            self._m.request_success.labels(self._m._label, "abort").inc()
