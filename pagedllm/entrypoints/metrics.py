"""Prometheus metrics (``/metrics``), named like vLLM's with a ``pagedllm:`` prefix:
recorded by the API server's engine, or by each data-parallel replica and merged by the
server (so they sit beside both, in the serving layer)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from pagedllm.core.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


def metrics_label(name: str) -> str:
    """The model's name in ``/metrics``, which stays open with --api-key: a served name
    that is a filesystem path (the default: the model argument) shows its last part."""
    if os.path.isabs(name) or (os.sep in name and os.path.exists(name)):
        return os.path.basename(os.path.normpath(name))
    return name


class Metrics:
    """Engine and request metrics for one served model. ``on_step`` runs on the engine
    thread after every step; prometheus-client's metrics are thread-safe."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(f"pagedllm:{name}", doc, labels + (extra or []), registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedllm:{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=r)

        self.model = model_name
        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use.")
        self.prefix_hit_rate = gauge(
            "prefix_cache_hit_rate", "Prefix-cache hits over queried tokens, since start."
        )
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the cache.")
        self.external_queries = counter(
            "external_prefix_cache_queries", "Prompt tokens looked up by the KV connector."
        )
        self.external_hits = counter(
            "external_prefix_cache_hits", "Prompt tokens loaded from the KV connector."
        )
        self.preemptions = counter("num_preemptions", "Requests preempted.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "request_success", "Finished requests, by finish reason.", ["finished_reason"]
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to the first token.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Mean time between tokens of a request.",
            _LATENCY_BUCKETS,
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", _LATENCY_BUCKETS
        )
        self.spec = {
            "drafts": counter("spec_decode_num_drafts", "Verification steps with draft tokens."),
            "draft_tokens": counter("spec_decode_num_draft_tokens", "Draft tokens proposed."),
            "accepted_tokens": counter(
                "spec_decode_num_accepted_tokens", "Draft tokens kept by verification."
            ),
        }
        self._last_spec = dict.fromkeys(self.spec, 0)
        self._last_queries = 0
        self._last_hits = 0
        self._last_external = (0, 0)
        self._last_preemptions = 0
        self._last_prompt = 0
        self._last_generation = 0

    def on_step(self, engine: Any, outputs: list[RequestOutput]) -> None:
        m = self.model
        stats = engine.stat_logger.snapshot()
        self.num_running.labels(m).set(stats.num_running)
        self.num_waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self.prefix_hit_rate.labels(m).set(stats.prefix_cache_hit_rate)
        self.prefix_queries.labels(m).inc(stats.prefix_cache_queries - self._last_queries)
        self.prefix_hits.labels(m).inc(stats.prefix_cache_hits - self._last_hits)
        self.preemptions.labels(m).inc(stats.num_preemptions - self._last_preemptions)
        self.prompt_tokens.labels(m).inc(stats.prompt_tokens - self._last_prompt)
        self.generation_tokens.labels(m).inc(stats.generation_tokens - self._last_generation)
        self._last_queries, self._last_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self.external_queries.labels(m).inc(stats.kv_transfer_queries - self._last_external[0])
        self.external_hits.labels(m).inc(stats.kv_transfer_hits - self._last_external[1])
        self._last_external = (stats.kv_transfer_queries, stats.kv_transfer_hits)
        self._last_preemptions = stats.num_preemptions
        self._last_prompt, self._last_generation = stats.prompt_tokens, stats.generation_tokens
        for key, metric in self.spec.items():
            value = getattr(stats, f"spec_{key}")
            metric.labels(m).inc(value - self._last_spec[key])
            self._last_spec[key] = value
        for output in outputs:
            if output.finished:
                self.on_finished(output)

    def on_finished(self, output: RequestOutput) -> None:
        m = self.model
        # (a pooling request's output is its pooled result: it ends once, stopped)
        completions = output.outputs if isinstance(output.outputs, list) else []
        for reason in [c.finish_reason or "abort" for c in completions] or ["stop"]:
            self.request_success.labels(m, reason).inc()
        metrics = output.metrics
        if metrics is None:
            return
        if metrics.first_scheduled_time is not None:
            self.queue_time.labels(m).observe(metrics.first_scheduled_time - metrics.arrival_time)
        if metrics.first_token_time is not None:
            self.ttft.labels(m).observe(metrics.first_token_time - metrics.arrival_time)
        if metrics.finished_time is not None:
            self.e2e.labels(m).observe(metrics.finished_time - metrics.arrival_time)
            tokens = metrics.num_generation_tokens
            if metrics.first_token_time is not None and tokens > 1:
                self.itl.labels(m).observe(
                    (metrics.last_token_time - metrics.first_token_time) / (tokens - 1)
                )

    async def exposition(self, engine: Any) -> bytes:
        """``/metrics``' body (``engine``: the server's ``AsyncLLMEngine``)."""
        self.refresh(engine.engine)
        return generate_latest(self.registry)

    def refresh(self, engine: Any) -> None:
        """Gauges read fresh before a scrape (an idle engine runs no steps)."""
        stats = engine.stat_logger.snapshot()
        self.num_running.labels(self.model).set(stats.num_running)
        self.num_waiting.labels(self.model).set(stats.num_waiting)
        self.kv_usage.labels(self.model).set(stats.kv_cache_usage)


class ReplicaMetrics:
    """Metrics of data-parallel replicas (``--data-parallel-size``): each replica keeps
    its own :class:`Metrics` in its process (its steps and its requests), and a scrape
    gathers them all, each sample labelled ``engine="<replica index>"`` as vLLM does.
    Every front end of ``--api-server-count`` answers with every replica's metrics,
    whichever front end sent the requests; sum over ``engine`` for the server's totals.

    ``engine``: the server's ``DataParallelClient``. ``registry`` collects the same for
    prometheus-client's own HTTP server (``run-batch --enable-metrics``), blocking its
    thread while the replicas answer."""

    # How long a scrape waits for the replicas.
    TIMEOUT_S = 30.0

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.registry = self

    async def exposition(self, engine: Any) -> bytes:
        families = await asyncio.wait_for(
            asyncio.wrap_future(engine.metric_families()), self.TIMEOUT_S
        )
        return generate_latest(_Merged(families))

    def collect(self) -> list[Metric]:
        return _Merged(self.engine.metric_families().result(self.TIMEOUT_S)).collect()


class _Merged:
    """Families of the same name from several replicas as one family (a collector)."""

    def __init__(self, per_replica: list[list[Metric]]) -> None:
        self.per_replica = per_replica

    def collect(self) -> list[Metric]:
        merged: dict[str, Metric] = {}
        for index, families in enumerate(self.per_replica):
            for family in families:
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for sample in family.samples:
                    labels = {**sample.labels, "engine": str(index)}
                    into.samples.append(sample._replace(labels=labels))
        return list(merged.values())
