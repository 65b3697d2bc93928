"""The ``LLM`` class with ``otlp_traces_endpoint`` (and ``collect_detailed_traces``)
exports a span per request to a local OTLP/HTTP receiver, as the server does."""

from __future__ import annotations

import pytest
from otlp_receiver import OTLPReceiver
from tiny_models import make_checkpoint

from pagedllm import LLM, SamplingParams

pytest.importorskip("opentelemetry.sdk")

MODEL_TIMINGS = ("gen_ai.latency.time_in_model_forward", "gen_ai.latency.time_in_model_execute")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def receiver(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    receiver = OTLPReceiver()
    yield receiver
    receiver.close()


def build(ckpt, receiver: OTLPReceiver, **kwargs) -> LLM:
    return LLM(
        str(ckpt),
        dtype="float32",
        disable_log_stats=True,
        num_gpu_blocks_override=64,
        otlp_traces_endpoint=receiver.endpoint,
        **kwargs,
    )


def test_offline_requests_get_spans_with_the_model_timings_asked_for(ckpt, receiver):
    llm = build(ckpt, receiver, collect_detailed_traces=["all"])
    try:
        params = SamplingParams(n=2, max_tokens=3, temperature=0.8, seed=1, ignore_eos=True)
        outputs = llm.generate(["Hello world", "Once upon a time"], params, use_tqdm=False)
    finally:
        llm.shutdown()
    spans = receiver.wait_until(lambda s: True, count=2)
    assert len(spans) == 2
    by_id = {s.attributes["gen_ai.request.id"]: s for s in spans}
    assert set(by_id) == {o.request_id for o in outputs}
    for output in outputs:
        span = by_id[output.request_id]
        a = span.attributes
        assert span.name == "llm_request" and span.parent_span_id == ""
        assert a["gen_ai.usage.prompt_tokens"] == len(output.prompt_token_ids)
        assert a["gen_ai.usage.completion_tokens"] == 6  # (both sequences)
        assert a["gen_ai.usage.num_sequences"] == a["gen_ai.request.n"] == 2
        assert a["gen_ai.request.max_tokens"] == 3
        assert a["gen_ai.request.temperature"] == pytest.approx(0.8)
        assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"]
        assert a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
        # Summed over the request's steps: forward passes within whole steps, within the
        # request's time in the engine.
        forward, execute = (a[name] for name in MODEL_TIMINGS)
        assert 0 < forward <= execute <= a["gen_ai.latency.e2e"]


def test_without_detailed_traces_no_step_is_timed(ckpt, receiver):
    llm = build(ckpt, receiver)
    try:
        assert not llm.llm_engine.executor.runner.time_steps
        llm.generate(["Hello world"], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    [span] = receiver.wait_until(lambda s: True)
    assert not set(MODEL_TIMINGS) & set(span.attributes)
    assert span.attributes["gen_ai.usage.completion_tokens"] >= 1


def test_tensor_parallel_rank_zero_times_its_steps(ckpt, receiver):
    # (the multiprocess executor builds rank 0's steps itself: its timing path)
    llm = build(ckpt, receiver, collect_detailed_traces=["model", "worker"], tensor_parallel_size=2)
    try:
        assert llm.llm_engine.executor.runner.time_steps
        llm.generate(["Hello world"], SamplingParams(max_tokens=3), use_tqdm=False)
    finally:
        llm.shutdown()
    [span] = receiver.wait_until(lambda s: True)
    forward, execute = (span.attributes[name] for name in MODEL_TIMINGS)
    assert 0 < forward <= execute <= span.attributes["gen_ai.latency.e2e"]
