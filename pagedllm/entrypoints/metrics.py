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

# Histogram buckets as vLLM's (0.32), so that quantiles read the same on both.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


# The metrics vLLM has under the same name (after its ``vllm:`` prefix), with the same
# type, labels and meaning: ``--metrics-prefix vllm`` exports these as ``vllm:<name>``.
VLLM_METRICS = frozenset(
    {
        "num_requests_running",
        "num_requests_waiting",
        "engine_sleep_state",
        "kv_cache_usage_perc",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "external_prefix_cache_queries",
        "external_prefix_cache_hits",
        "num_preemptions",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_inference_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_max_num_generation_tokens",
        "request_params_n",
        "request_params_max_tokens",
        "request_num_preemptions",
        "request_prefill_kv_computed_tokens",
        "iteration_tokens_total",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
    }
)


def metrics_label(name: str) -> str:
    """The model's name in ``/metrics``, which stays open with --api-key: a served name
    that is a filesystem path (the default: the model argument) shows its last part."""
    if os.path.isabs(name) or (os.sep in name and os.path.exists(name)):
        return os.path.basename(os.path.normpath(name))
    return name


class Metrics:
    """Engine and request metrics for one served model. ``on_step`` runs on the engine
    thread after every step; prometheus-client's metrics are thread-safe.

    The names, types, labels and meanings follow vLLM's (see :data:`VLLM_METRICS`), which
    ``prefix="vllm"`` exports under vLLM's own names, with its ``engine`` label."""

    def __init__(self, model_name: str, max_model_len: int, prefix: str = "pagedllm") -> None:
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
        self.prefix = prefix
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
            "time_to_first_token_seconds", "Arrival to the first token.", _TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between a request's consecutive tokens (one per request and step).",
            _ITL_BUCKETS,
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "A finished request's first to last token over its tokens after the first.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", _REQUEST_LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "First scheduling to the last token.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "First scheduling to the first token.",
            _REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "First to last token.", _REQUEST_LATENCY_BUCKETS
        )
        tokens = request_tokens_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "A finished request's prompt tokens.", tokens
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "A finished request's generated tokens (all its sequences).",
            tokens,
        )
        self.request_max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "A finished request's longest sequence, in tokens.",
            tokens,
        )
        self.request_n = histogram(
            "request_params_n", "The n of finished requests.", _PARAMS_N_BUCKETS
        )
        self.request_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of finished requests.", tokens
        )
        self.request_preemptions = histogram(
            "request_num_preemptions", "A finished request's preemptions.", _PREEMPTIONS_BUCKETS
        )
        self.request_prefill_computed = histogram(
            "request_prefill_kv_computed_tokens",
            "A finished request's prompt tokens computed (not found in the prefix cache).",
            tokens,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed per engine step.", _ITERATION_TOKENS_BUCKETS
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
        step_tokens, latencies = engine.stat_logger.take_samples()
        iteration, itl = self.iteration_tokens.labels(m), self.itl.labels(m)
        for count in step_tokens:
            iteration.observe(count)
        for seconds in latencies:
            itl.observe(seconds)
        for output in outputs:
            if output.finished:
                self.on_finished(output)

    def on_aborted(self, outputs: list[RequestOutput]) -> None:
        """Requests aborted between steps (a client gone, a failed step): counted as
        vLLM counts them, finished with reason "abort"."""
        for output in outputs:
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
        prompt = len(output.prompt_token_ids or ())
        self.request_prompt_tokens.labels(m).observe(prompt)
        self.request_prefill_computed.labels(m).observe(prompt - max(output.num_cached_tokens, 0))
        self.request_generation_tokens.labels(m).observe(sum(len(c.token_ids) for c in completions))
        self.request_max_generation_tokens.labels(m).observe(metrics.num_generation_tokens)
        self.request_n.labels(m).observe(metrics.n)
        if metrics.max_tokens:
            self.request_max_tokens.labels(m).observe(metrics.max_tokens)
        self.request_preemptions.labels(m).observe(metrics.num_preemptions)
        scheduled, first, last = (
            metrics.first_scheduled_time,
            metrics.first_token_time,
            metrics.last_token_time,
        )
        if scheduled is not None:
            self.queue_time.labels(m).observe(scheduled - metrics.arrival_time)
        if first is not None:
            self.ttft.labels(m).observe(first - metrics.arrival_time)
        if scheduled is not None and first is not None and last is not None:
            self.prefill_time.labels(m).observe(first - scheduled)
            self.decode_time.labels(m).observe(last - first)
            self.inference_time.labels(m).observe(last - scheduled)
        if metrics.finished_time is not None:
            self.e2e.labels(m).observe(metrics.finished_time - metrics.arrival_time)
            tokens = metrics.num_generation_tokens
            if first is not None and last is not None and tokens > 1:
                self.tpot.labels(m).observe((last - first) / (tokens - 1))

    async def exposition(self, engine: Any) -> bytes:
        """``/metrics``' body (``engine``: the server's ``AsyncLLMEngine``)."""
        self.refresh(engine.engine)
        return generate_latest(self.exported())

    def exported(self) -> Any:
        """A collector of the families under the names ``prefix`` chooses."""
        return _VLLMNames(self.registry, engine="0") if self.prefix == "vllm" else self.registry

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

    ``engine``: the server's ``DataParallelClient``. :meth:`exported` collects the same
    for prometheus-client's own HTTP server (``run-batch --enable-metrics``), blocking its
    thread while the replicas answer."""

    # How long a scrape waits for the replicas.
    TIMEOUT_S = 30.0

    def __init__(self, engine: Any, prefix: str = "pagedllm") -> None:
        self.engine = engine
        self.prefix = prefix

    async def exposition(self, engine: Any) -> bytes:
        families = await asyncio.wait_for(
            asyncio.wrap_future(engine.metric_families()), self.TIMEOUT_S
        )
        merged = _Merged(families)
        return generate_latest(_VLLMNames(merged) if self.prefix == "vllm" else merged)

    def exported(self) -> Any:
        return _VLLMNames(self) if self.prefix == "vllm" else self

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


class _VLLMNames:
    """A collector of ``source``'s families with vLLM's names: ``pagedllm:<name>`` as
    ``vllm:<name>`` where vLLM has that metric (:data:`VLLM_METRICS`), the others
    unchanged; ``engine``: the ``engine`` label to add to every sample (vLLM labels a
    single engine's ``"0"``; data-parallel replicas have theirs already)."""

    def __init__(self, source: Any, engine: str | None = None) -> None:
        self.source = source
        self.engine = engine

    def collect(self) -> list[Metric]:
        renamed = []
        for family in self.source.collect():
            base = family.name.removeprefix("pagedllm:")
            name = f"vllm:{base}" if base in VLLM_METRICS else family.name
            into = Metric(name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = (
                    sample.labels
                    if self.engine is None
                    else {**sample.labels, "engine": self.engine}
                )
                into.samples.append(
                    sample._replace(name=name + sample.name[len(family.name) :], labels=labels)
                )
            renamed.append(into)
        return renamed
