"""OpenTelemetry traces (``--otlp-traces-endpoint``): one span per request, exported when
it finishes or is aborted, as vLLM exports them: named ``llm_request``, of kind SERVER,
from the request's arrival to its end, with vLLM's attribute names, and a child of the
W3C ``traceparent``/``tracestate`` headers it came with.

The serving layer (and the ``LLM`` class) calls :meth:`RequestTracer.start` when it
submits a request and feeds the tracer the engine's outputs; spans go out in batches on
the SDK's background thread, so an endpoint that is down costs no request anything.
OpenTelemetry is the optional ``otel`` extra, imported only when the flag is set.
"""

from __future__ import annotations

import atexit
import collections
import contextvars
import dataclasses
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.sampling import RequestOutputKind

if TYPE_CHECKING:
    from pagedllm.core.configs.scheduling import ObservabilityConfig
    from pagedllm.core.outputs import RequestOutput

OTEL_EXTRA = "pip install 'pagedllm[otel]'"
TRACE_HEADERS = ("traceparent", "tracestate")
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
SPAN_NAME = "llm_request"

# The trace headers of the HTTP request being served (set by the routes, read where the
# request is submitted).
incoming_trace_headers: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "pagedllm_trace_headers", default=None
)


class SpanAttributes:
    """vLLM's attribute names (OpenTelemetry's gen_ai conventions and its own)."""

    REQUEST_ID = "gen_ai.request.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_N = "gen_ai.request.n"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"


def trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace headers among an HTTP request's ``headers`` (None when none)."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None


@dataclasses.dataclass(slots=True)
class _Pending:
    """What the tracer knows of a request before it ends."""

    headers: dict[str, str] | None
    params: Any
    model: str | None
    # Sequence index -> its tokens so far (outputs may carry only the new ones).
    tokens: dict[int, int] = dataclasses.field(default_factory=dict)


class RequestTracer:
    """Spans of one engine's requests (see the module's docstring)."""

    # Requests remembered at most: one that fails in the engine never reaches the tracer
    # again, and the oldest entries go first (far more than can be in flight at once).
    MAX_PENDING = 65536

    def __init__(self, config: ObservabilityConfig, model_name: str) -> None:
        otel = _import_otel()
        endpoint = config.otlp_traces_endpoint
        assert endpoint is not None
        self.model_name = model_name
        self.forward_time = config.collect_model_forward_time
        self.execute_time = config.collect_model_execute_time
        resource = otel["Resource"].create(
            {
                "pagedllm.instrumenting_module_name": "pagedllm.llm_engine",
                "pagedllm.process_id": str(os.getpid()),
            }
        )
        self.provider = otel["TracerProvider"](resource=resource)
        self.provider.add_span_processor(otel["BatchSpanProcessor"](_span_exporter(endpoint, otel)))
        atexit.register(self.shutdown)
        self.tracer = self.provider.get_tracer("pagedllm.llm_engine")
        self.server_kind = otel["SpanKind"].SERVER
        self.propagator = otel["TraceContextTextMapPropagator"]()
        self._pending: collections.OrderedDict[str, _Pending] = collections.OrderedDict()
        self._lock = threading.Lock()  # (start on the event loop; the rest on the engine's)
        self._closed = False

    @classmethod
    def for_config(cls, config: ObservabilityConfig, model_name: str) -> RequestTracer | None:
        """The tracer ``config`` asks for, or None without --otlp-traces-endpoint."""
        if not config.otlp_traces_endpoint:
            return None
        return cls(config, model_name)

    # ------------------------------------------------------------------ requests

    def start(
        self,
        request_id: str,
        params: Any,
        headers: dict[str, str] | None = None,
        model: str | None = None,
    ) -> None:
        """Remember a request submitted to the engine (``headers``: its trace headers;
        ``model``: the name it asked for, a LoRA adapter's or the served one)."""
        with self._lock:
            self._pending[request_id] = _Pending(headers, params, model)
            while len(self._pending) > self.MAX_PENDING:
                self._pending.popitem(last=False)

    def on_step(self, engine: Any, outputs: list[RequestOutput]) -> None:
        """A step's outputs (an engine step listener): finished requests get their span."""
        for output in outputs:
            with self._lock:
                pending = (
                    self._pending.pop(output.request_id, None)
                    if output.finished
                    else self._pending.get(output.request_id)
                )
            if pending is not None:
                _count_tokens(pending, output)
            if output.finished:
                self.export(output, pending)

    def on_aborted(self, outputs: list[RequestOutput]) -> None:
        """The last outputs of aborted requests (their token ids in full)."""
        for output in outputs:
            with self._lock:
                pending = self._pending.pop(output.request_id, None)
            if pending is not None:
                pending.tokens.clear()
                _count_tokens(pending, output)
            self.export(output, pending)

    # --------------------------------------------------------------------- spans

    def export(self, output: RequestOutput, pending: _Pending | None) -> None:
        metrics = output.metrics
        if metrics is None or self._closed:
            return
        # The engine's times are monotonic; a span's are nanoseconds since the epoch.
        to_epoch = time.time() - time.monotonic()
        end = metrics.finished_time if metrics.finished_time is not None else time.monotonic()
        attributes = self.attributes(output, pending, end)
        headers = pending.headers if pending is not None else None
        context = self.propagator.extract(headers) if headers else None
        span = self.tracer.start_span(
            SPAN_NAME,
            context=context,
            kind=self.server_kind,
            attributes=attributes,
            start_time=int((metrics.arrival_time + to_epoch) * 1e9),
        )
        span.end(end_time=int((end + to_epoch) * 1e9))

    def attributes(
        self, output: RequestOutput, pending: _Pending | None, end: float
    ) -> dict[str, Any]:
        """The span's attributes, in vLLM's names and units (seconds)."""
        a = SpanAttributes
        metrics = output.metrics
        assert metrics is not None
        model = pending.model if pending is not None and pending.model else self.model_name
        completions = output.outputs if isinstance(output.outputs, list) else []
        if pending is not None and pending.tokens:
            completion_tokens = sum(pending.tokens.values())
        else:
            completion_tokens = sum(len(c.token_ids) for c in completions)
        values: dict[str, Any] = {
            a.REQUEST_ID: output.request_id,
            a.RESPONSE_MODEL: model,
            a.USAGE_PROMPT_TOKENS: len(output.prompt_token_ids or ()),
            a.USAGE_COMPLETION_TOKENS: completion_tokens,
            a.USAGE_NUM_SEQUENCES: len(completions) or 1,
            a.LATENCY_E2E: end - metrics.arrival_time,
        }
        params = pending.params if pending is not None else None
        for name, key in (
            (a.REQUEST_MAX_TOKENS, "max_tokens"),
            (a.REQUEST_TEMPERATURE, "temperature"),
            (a.REQUEST_TOP_P, "top_p"),
            (a.REQUEST_N, "n"),
        ):
            value = getattr(params, key, None)
            if value is not None:
                values[name] = value
        scheduled, first, last = (
            metrics.first_scheduled_time,
            metrics.first_token_time,
            metrics.last_token_time,
        )
        if scheduled is not None:
            values[a.LATENCY_TIME_IN_QUEUE] = scheduled - metrics.arrival_time
        if first is not None:
            values[a.LATENCY_TIME_TO_FIRST_TOKEN] = first - metrics.arrival_time
        if scheduled is not None and first is not None and last is not None:
            values[a.LATENCY_TIME_IN_MODEL_PREFILL] = first - scheduled
            values[a.LATENCY_TIME_IN_MODEL_DECODE] = last - first
            values[a.LATENCY_TIME_IN_MODEL_INFERENCE] = last - scheduled
        if self.forward_time and metrics.model_forward_time is not None:
            values[a.LATENCY_TIME_IN_MODEL_FORWARD] = metrics.model_forward_time
        if self.execute_time and metrics.model_execute_time is not None:
            values[a.LATENCY_TIME_IN_MODEL_EXECUTE] = metrics.model_execute_time
        return values

    def shutdown(self) -> None:
        """Send the spans still batched (waits for the exporter, bounded by its timeout)."""
        if self._closed:
            return
        self._closed = True
        self.provider.shutdown()


def _count_tokens(pending: _Pending, output: RequestOutput) -> None:
    completions = output.outputs if isinstance(output.outputs, list) else []
    delta = getattr(pending.params, "output_kind", None) is RequestOutputKind.DELTA
    for c in completions:
        count = len(c.token_ids)
        pending.tokens[c.index] = pending.tokens.get(c.index, 0) + count if delta else count


def _import_otel() -> dict[str, Any]:
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as exc:
        raise ConfigError(
            f"--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporter ({exc}); "
            f"install them with {OTEL_EXTRA}"
        ) from None
    return {
        "Resource": Resource,
        "TracerProvider": TracerProvider,
        "BatchSpanProcessor": BatchSpanProcessor,
        "SpanKind": SpanKind,
        "TraceContextTextMapPropagator": TraceContextTextMapPropagator,
    }


def _span_exporter(endpoint: str, otel: dict[str, Any]) -> Any:
    """The OTLP exporter of ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (grpc when unset, as
    in vLLM)."""
    protocol = os.environ.get(PROTOCOL_ENV, "grpc")
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise ConfigError(
                f"{PROTOCOL_ENV}=http/protobuf needs opentelemetry-exporter-otlp-proto-http "
                f"({exc}); install it with {OTEL_EXTRA}"
            ) from None
        return OTLPSpanExporter(endpoint=endpoint)
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError as exc:
            raise ConfigError(
                f"--otlp-traces-endpoint: the OTLP protocol is grpc (vLLM's default when "
                f"{PROTOCOL_ENV} is unset), whose exporter is not installed ({exc}): "
                f"set {PROTOCOL_ENV}=http/protobuf (and an http endpoint such as "
                "http://HOST:4318/v1/traces), or pip install opentelemetry-exporter-otlp-proto-grpc"
            ) from None
        return GrpcSpanExporter(endpoint=endpoint, insecure=True)
    raise ConfigError(
        f"{PROTOCOL_ENV}={protocol!r} is not an OTLP traces protocol pagedllm supports "
        "(choose from grpc, http/protobuf)"
    )
