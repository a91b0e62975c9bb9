"""The server's Prometheus metrics (``GET /metrics``), under vLLM v1's names so that its dashboards and autoscalers
read them unchanged. Every series has the label ``model_name``.

Read from the engine when scraped (nothing on the engine's hot path but integer counters, engine/scheduler.py's
EngineStats): ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` (sequences: a request of n choices
counts n, as vLLM v1 fans it out), ``vllm:kv_cache_usage_perc`` (used KV pages / pages, 0..1),
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:num_preemptions_total``,
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (prompt tokens looked up / found in a prefix
cache; 0 while the engine has none).

Observed per request as its tokens reach the HTTP side (timestamps taken on the engine thread when the step's
tokens were read): ``vllm:time_to_first_token_seconds`` (from the request's arrival),
``vllm:inter_token_latency_seconds`` (between a choice's successive tokens), ``vllm:e2e_request_latency_seconds``
and ``vllm:request_success_total`` by ``finished_reason`` (stop / length; aborted requests are not successes).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from flashdecode.engine.server.async_engine import AsyncEngine, Delta, RequestStream

# Bucket bounds in seconds: a decode step takes milliseconds on a GPU (ITL), a prefill up to seconds (TTFT).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


class _EngineCollector:
    """The scheduler's state and the engine's counters, read at scrape time (another thread reads lengths and
    integers the engine thread writes: each read is atomic)."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine, self.labels = engine, [model_name]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(self.labels, value)
        return family

    def _counter(self, name: str, doc: str, value: int) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric(self.labels, value)
        return family

    def collect(self):
        llm = self.engine.llm
        scheduler, blocks, stats = llm.scheduler, llm.block_manager, llm.scheduler.stats
        yield self._gauge("vllm:num_requests_running", "Sequences in the engine's running batch.",
                          len(scheduler.running))
        yield self._gauge("vllm:num_requests_waiting", "Sequences submitted and waiting to be scheduled.",
                          len(scheduler.waiting) + self.engine.num_unadmitted)
        yield self._gauge("vllm:kv_cache_usage_perc", "Fraction of the KV cache pages in use (0..1).",
                          1.0 - blocks.num_free / blocks.num_pages)
        yield self._counter("vllm:prompt_tokens", "Prompt tokens processed.", stats.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield self._counter("vllm:num_preemptions", "Preemptions (a sequence's pages freed, to be recomputed).",
                            scheduler.num_preemptions)
        yield self._counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                            stats.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                            stats.prefix_cache_hits)


class ServerMetrics:
    """The registry behind /metrics (one per app, so that several servers in one process keep apart) and the
    per-request observations. ``observe`` is the AsyncEngine's request observer (called on the event loop)."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (from arrival).", labels,
                              buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between a sequence's successive tokens.",
                             labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token of a sequence.", labels,
                             buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.success = Counter("vllm:request_success", "Sequences finished, by finish reason.",
                               labels + ["finished_reason"], registry=self.registry)
        self.registry.register(_EngineCollector(engine, model_name))

    def observe(self, stream: RequestStream, deltas: list[Delta], when: float) -> None:
        """Record what ``deltas`` (read from the engine at monotonic time ``when``) say about ``stream``."""
        for d in deltas:
            if d.token_ids:
                last = stream.token_times.get(d.index)
                if last is None:
                    self.ttft.observe(when - stream.arrival)
                else:
                    self.itl.observe(when - last)
                stream.token_times[d.index] = when
            if d.finish_reason is not None:
                self.success.labels(self.model_name, d.finish_reason).inc()
                self.e2e.observe(when - stream.arrival)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
