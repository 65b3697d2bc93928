"""A local OTLP/HTTP traces receiver for the tests of ``--otlp-traces-endpoint``: it takes
``POST /v1/traces`` (protobuf), decodes each body with opentelemetry-proto's
``ExportTraceServiceRequest`` and keeps the spans; ``hang()`` makes it hold every export
unanswered (a collector that is down in the worst way) until ``release()``."""

from __future__ import annotations

import http.server
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Span:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    scope: str


def new_traceparent() -> tuple[str, str, str]:
    """A W3C ``traceparent`` header value with its trace id and parent span id (hex)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


class OTLPReceiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.posts = 0
        self._changed = threading.Condition()
        self._open = threading.Event()
        self._open.set()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver._open.wait()
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver._add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                try:
                    self.send_response(200)
                    self.send_header("content-type", "application/x-protobuf")
                    self.send_header("content-length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                except OSError:  # (an exporter that gave up waiting closed the connection)
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        Span(
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={
                                kv.key: getattr(kv.value, kv.value.WhichOneof("value"))
                                for kv in span.attributes
                            },
                            scope=scope_spans.scope.name,
                        )
                    )
        with self._changed:
            self.posts += 1
            self.spans.extend(spans)
            self._changed.notify_all()

    def wait_for(self, trace_id: str, count: int = 1, timeout: float = 60.0) -> list[Span]:
        """The spans of trace ``trace_id`` once ``count`` have come (AssertionError after
        ``timeout`` seconds)."""
        return self.wait_until(lambda s: s.trace_id == trace_id, count, timeout)

    def wait_until(
        self, matches: Callable[[Span], bool], count: int = 1, timeout: float = 60.0
    ) -> list[Span]:
        """The spans that ``matches`` once ``count`` have come."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [s for s in self.spans if matches(s)]
                if len(found) >= count:
                    return found
                left = deadline - time.monotonic()
                assert left > 0, f"{len(found)} of {count} spans came"
                self._changed.wait(left)

    def hang(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()
