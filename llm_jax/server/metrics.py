"""``GET /metrics``: Prometheus metrics, named as vLLM names them with an ``llm_jax:`` prefix.

Latencies (histograms, seconds, per engine request): ``time_to_first_token_seconds`` from the HTTP
request's arrival, ``inter_token_latency_seconds`` between a request's tokens,
``e2e_request_latency_seconds`` from arrival to finish. Counters: ``prompt_tokens_total``,
``generation_tokens_total``, ``request_success_total`` by ``finished_reason`` (stop, length, abort),
``requests_rejected_total`` by ``reason`` (queue_full). Read from the engine's scheduler when scraped:
``num_requests_running`` and ``num_requests_waiting``, ``kv_cache_usage_perc`` (blocks held by requests
over the pool, 0 to 1), ``prefix_cache_queries_total`` and ``prefix_cache_hits_total`` (tokens),
``num_preemptions_total``; with speculative decoding ``spec_decode_num_drafts_total`` (sequence steps that
verified proposals), ``spec_decode_num_draft_tokens_total`` (proposals), ``spec_decode_num_accepted_tokens_total``
and ``spec_decode_num_accepted_tokens_per_pos_total`` by ``position`` (0 for the first proposal); the
acceptance rate is accepted over draft tokens, the mean accepted length 1 + accepted over drafts; with
LoRA adapters ``lora_requests_info`` (as vLLM's: labels ``max_lora``, ``running_lora_adapters`` and
``waiting_lora_adapters``, comma-separated names; the value the scrape's time). Each server has its own
registry, so several can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "llm_jax:"
# Seconds: a token on a small CPU model takes about a millisecond, on a large one over a second.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _SchedulerCollector(Collector):
    """The engine's state at scrape time (``stats`` returns a ``SchedulerStats``)."""

    def __init__(self, stats: Callable, model_name: str, lora: Callable | None = None):
        self._stats, self._model_name, self._lora = stats, model_name, lora

    def collect(self) -> Iterator[Metric]:
        stats, labels = self._stats(), [self._model_name]
        for family, name, doc, value in (
                (GaugeMetricFamily, "num_requests_running", "Requests in the engine's running batch.",
                 stats.num_running),
                (GaugeMetricFamily, "num_requests_waiting", "Requests queued in the engine (preempted ones too).",
                 stats.num_waiting),
                (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0 to 1).",
                 stats.kv_usage),
                (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 stats.prefix_queried_tokens),
                (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 stats.prefix_hit_tokens),
                (CounterMetricFamily, "num_preemptions", "Requests preempted to free KV-cache blocks.",
                 stats.num_preemptions),
                (CounterMetricFamily, "spec_decode_num_drafts", "Sequence steps that verified proposals.",
                 stats.spec_steps),
                (CounterMetricFamily, "spec_decode_num_draft_tokens", "Proposed tokens verified.",
                 stats.spec_proposed_tokens),
                (CounterMetricFamily, "spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                 stats.spec_accepted_tokens)):
            metric = family(PREFIX + name, doc, labels=["model_name"])
            metric.add_metric(labels, value)
            yield metric
        per_position = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                           "Proposed tokens accepted, by their position among a step's proposals.",
                                           labels=["model_name", "position"])
        for position, value in enumerate(stats.spec_accepted_per_position):
            per_position.add_metric([*labels, str(position)], value)
        yield per_position
        if self._lora is not None:
            max_lora, running, waiting = self._lora()
            info = GaugeMetricFamily(PREFIX + "lora_requests_info", "The LoRA adapters of running and waiting "
                                     "requests.", labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(max_lora), ",".join(running), ",".join(waiting)], time.time())
            yield info


class ServerMetrics:
    """One server's metrics; ``stats`` reads the engine's scheduler (``Engine.stats``; None: a server without
    an engine, a classifier's), ``lora`` (with adapters) the adapter slots and the adapters requests use:
    (slots, running names, waiting names)."""

    def __init__(self, stats: Callable | None, model_name: str, lora: Callable | None = None):
        self.registry = CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self._model_name = model_name
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token, from the request's "
                              "arrival.", buckets=TOKEN_BUCKETS, **labels).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between a request's tokens.",
                             buckets=TOKEN_BUCKETS, **labels).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from a request's arrival to its "
                             "last token.", buckets=REQUEST_BUCKETS, **labels).labels(model_name)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of the engine requests that "
                                     "produced a token.", **labels).labels(model_name)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", **labels).labels(model_name)
        self._finished = Counter(PREFIX + "request_success", "Engine requests finished, by reason.",
                                 labelnames=["model_name", "finished_reason"], registry=self.registry)
        self._rejected = Counter(PREFIX + "requests_rejected", "HTTP requests refused for lack of room, by reason.",
                                 labelnames=["model_name", "reason"], registry=self.registry)
        if stats is not None:  # an engine's server (a classifier's has none)
            self.registry.register(_SchedulerCollector(stats, model_name, lora))

    def finished(self, reason: str) -> None:
        self._finished.labels(self._model_name, reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self._model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
