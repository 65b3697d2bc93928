"""``--otlp-traces-endpoint`` and ``--collect-detailed-traces`` of a real ``pagedllm serve``,
exporting over OTLP/HTTP to a local receiver: one span per request (finished or
cancelled), a child of the request's ``traceparent``, with vLLM's attribute names."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from conftest import clean_env, run_cli
from openai_server import RemoteServer, tiny_llama
from otlp_receiver import OTLPReceiver, Span, new_traceparent

# (a span batch goes out 50 ms after it starts, not 5 s: the tests wait less; an export
# that gets no answer gives up after 5 s)
OTEL_ENV = {
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
    "OTEL_BSP_SCHEDULE_DELAY": "50",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "5",
}
SPAN_KIND_SERVER = 2  # (opentelemetry-proto's Span.SpanKind)


@pytest.fixture(scope="module")
def receiver():
    receiver = OTLPReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model: Path, receiver: OTLPReceiver):
    log = tmp_path_factory.mktemp("server_traces") / "server.log"
    server = RemoteServer(
        model,
        "--otlp-traces-endpoint",
        receiver.endpoint,
        "--collect-detailed-traces",
        "model",
        log_path=log,
        env=clean_env(**OTEL_ENV),
    )
    server.start().wait_ready()
    yield server
    server.stop()


def completion(server: RemoteServer, traceparent: str, **body: object) -> dict:
    with server.http(headers={"traceparent": traceparent}) as http:
        response = http.post("/v1/completions", json={"model": str(server_model(server)), **body})
    assert response.status_code == 200, response.text
    return response.json()


def server_model(server: RemoteServer) -> str:
    return server.command[server.command.index("serve") + 1]


def assert_latencies(span: Span) -> dict:
    a = span.attributes
    queue = a["gen_ai.latency.time_in_queue"]
    ttft = a["gen_ai.latency.time_to_first_token"]
    e2e = a["gen_ai.latency.e2e"]
    assert 0 <= queue <= ttft <= e2e, (queue, ttft, e2e)
    prefill = a["gen_ai.latency.time_in_model_prefill"]
    decode = a["gen_ai.latency.time_in_model_decode"]
    assert prefill >= 0 and decode >= 0
    assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(prefill + decode)
    # The span lasts from the request's arrival to its end.
    assert (span.end_ns - span.start_ns) / 1e9 == pytest.approx(e2e, abs=2e-3)
    assert abs(span.start_ns / 1e9 - time.time()) < 600
    return a


def test_a_completion_exports_one_child_span_of_its_traceparent(server, receiver):
    traceparent, trace_id, parent_id = new_traceparent()
    with server.http(headers={"traceparent": traceparent, "x-request-id": "traced-1"}) as http:
        response = http.post(
            "/v1/completions",
            json={
                "model": server_model(server),
                "prompt": "Hello there, how",
                "max_tokens": 6,
                "temperature": 0.5,
                "top_p": 0.9,
                "ignore_eos": True,
            },
        )
    assert response.status_code == 200, response.text
    body = response.json()
    [span] = receiver.wait_for(trace_id)
    assert span.name == "llm_request"
    assert span.kind == SPAN_KIND_SERVER
    assert span.parent_span_id == parent_id
    a = assert_latencies(span)
    assert a["gen_ai.request.id"] == "cmpl-traced-1"
    assert a["gen_ai.response.model"] == body["model"]
    assert a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.n"] == 1
    assert a["gen_ai.usage.prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == body["usage"]["completion_tokens"] == 6
    assert a["gen_ai.usage.num_sequences"] == 1
    # --collect-detailed-traces model: the forward passes' time, within the request's
    # time in the model; not the runner's whole steps ("worker").
    forward = a["gen_ai.latency.time_in_model_forward"]
    assert 0 < forward <= a["gen_ai.latency.e2e"]
    assert "gen_ai.latency.time_in_model_execute" not in a


def test_a_request_without_trace_headers_starts_its_own_trace(server, receiver):
    with server.http(headers={"x-request-id": "untraced-1"}) as http:
        response = http.post(
            "/v1/completions",
            json={"model": server_model(server), "prompt": "Hi", "max_tokens": 2, "n": 2},
        )
    assert response.status_code == 200, response.text
    [span] = receiver.wait_until(lambda s: s.attributes["gen_ai.request.id"] == "cmpl-untraced-1")
    assert span.parent_span_id == ""
    assert span.attributes["gen_ai.request.n"] == 2
    assert span.attributes["gen_ai.usage.num_sequences"] == 2
    usage = response.json()["usage"]
    assert span.attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]


def test_a_stream_cancelled_midway_still_exports_its_span(server, receiver):
    traceparent, trace_id, parent_id = new_traceparent()
    max_tokens = 240
    with (
        server.http(headers={"traceparent": traceparent}) as http,
        http.stream(
            "POST",
            "/v1/completions",
            json={
                "model": server_model(server),
                "prompt": "Once",
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            },
        ) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
    # (the connection closed after the first token: the server aborts the request)
    [span] = receiver.wait_for(trace_id)
    assert span.parent_span_id == parent_id
    a = assert_latencies(span)
    assert 1 <= a["gen_ai.usage.completion_tokens"] < max_tokens
    assert a["gen_ai.request.max_tokens"] == max_tokens


def test_a_collector_that_does_not_answer_neither_fails_nor_slows_requests(server, receiver):
    def timed_completion() -> float:
        traceparent, _, _ = new_traceparent()
        started = time.monotonic()
        body = completion(server, traceparent, prompt="Hello", max_tokens=4, ignore_eos=True)
        assert body["usage"]["completion_tokens"] == 4
        return time.monotonic() - started

    baseline = max(timed_completion() for _ in range(2))
    posts = receiver.posts
    receiver.hang()  # (every export now waits for an answer that does not come)
    try:
        hung = [timed_completion() for _ in range(3)]
        # An export made on the request's path would wait for the exporter's 5 s timeout.
        assert max(hung) < baseline + 2.5, (baseline, hung)
    finally:
        receiver.release()
    traceparent, trace_id, _ = new_traceparent()
    completion(server, traceparent, prompt="Hello", max_tokens=2)
    receiver.wait_for(trace_id)  # (exports go on once the collector answers)
    assert receiver.posts > posts


# ---------------------------------------------------------------- refused start-ups


def test_collect_detailed_traces_needs_an_endpoint(model):
    result = run_cli("serve", str(model), "--collect-detailed-traces", "all")
    assert result.returncode != 0
    assert "--collect-detailed-traces needs --otlp-traces-endpoint" in result.stderr


def test_the_grpc_protocol_without_its_exporter_is_refused_by_name(model):
    pytest.importorskip("opentelemetry.sdk")
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401

        pytest.skip("the grpc exporter is installed here")
    except ImportError:
        pass
    # (no OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: grpc, vLLM's default)
    result = run_cli(
        "serve", str(model), "--otlp-traces-endpoint", "http://127.0.0.1:4317", timeout=180
    )
    assert result.returncode != 0
    assert "the OTLP protocol is grpc" in result.stderr
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf" in result.stderr
    assert "opentelemetry-exporter-otlp-proto-grpc" in result.stderr


def test_an_unknown_protocol_is_refused(model):
    result = run_cli(
        "serve",
        str(model),
        "--otlp-traces-endpoint",
        "http://127.0.0.1:4318/v1/traces",
        env=clean_env(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/json"),
        timeout=180,
    )
    assert result.returncode != 0
    assert "'http/json' is not an OTLP traces protocol" in result.stderr
    assert "grpc, http/protobuf" in result.stderr


def test_without_opentelemetry_the_flag_names_the_extra(model, tmp_path):
    # (the SDK made unimportable in the server's interpreter, as where it is not installed)
    script = (
        "import sys; sys.modules['opentelemetry.sdk'] = None; "
        "sys.modules['opentelemetry.sdk.trace'] = None; "
        "from pagedllm.entrypoints.cli.main import main; sys.exit(main())"
    )
    import subprocess

    result = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "serve",
            str(model),
            "--otlp-traces-endpoint",
            "http://127.0.0.1:4318/v1/traces",
        ],
        capture_output=True,
        text=True,
        env=clean_env(**OTEL_ENV),
        timeout=180,
    )
    assert result.returncode != 0
    assert "pip install 'pagedllm[otel]'" in result.stderr


def test_data_parallel_replicas_are_refused_by_name(model):
    result = run_cli(
        "serve",
        str(model),
        "--otlp-traces-endpoint",
        "http://127.0.0.1:4318/v1/traces",
        "--data-parallel-size",
        "2",
        env=clean_env(**OTEL_ENV),
    )
    assert result.returncode != 0
    assert "--otlp-traces-endpoint" in result.stderr
    assert "--data-parallel-size" in result.stderr


def test_the_default_server_never_imports_the_sdk():
    script = (
        "import sys; import pagedllm; "
        "from pagedllm.entrypoints.openai import api_server, serving_setup; "
        "from pagedllm.entrypoints import llm, tracing; "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk') "
        "or m.startswith('opentelemetry.exporter')))"
    )
    import subprocess

    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=clean_env()
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
