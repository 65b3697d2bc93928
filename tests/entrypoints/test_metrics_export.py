"""The metrics' export outside the API server: ``run-batch --enable-metrics`` serves
them with prometheus-client's own HTTP server, under the names ``--metrics-prefix``
chooses."""

from __future__ import annotations

import httpx
import pytest
from openai_server import free_port

from pagedllm.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.entrypoints.cli.run_batch import metrics_server
from pagedllm.entrypoints.cli.run_batch_args import RunBatchArgs
from pagedllm.entrypoints.metrics import Metrics


def _finished(tokens: int) -> RequestOutput:
    metrics = RequestMetrics(
        arrival_time=10.0,
        first_scheduled_time=10.5,
        first_token_time=11.0,
        last_token_time=13.0,
        finished_time=13.0,
        num_generation_tokens=tokens,
        max_tokens=tokens,
    )
    completion = CompletionOutput(
        index=0,
        text="",
        token_ids=list(range(tokens)),
        cumulative_logprob=None,
        logprobs=None,
        finish_reason="length",
    )
    return RequestOutput("r", None, [1, 2, 3], None, [completion], True, 0, metrics)


@pytest.mark.parametrize("prefix", ["pagedllm", "vllm"])
def test_run_batch_metrics_server_uses_the_prefix(prefix: str) -> None:
    metrics = Metrics("tiny", max_model_len=64, prefix=prefix)
    metrics.on_finished(_finished(5))
    port = free_port()
    args = RunBatchArgs(enable_metrics=True, url="127.0.0.1", port=port, metrics_prefix=prefix)
    with metrics_server(args, metrics.exported()):
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    labels = 'engine="0",' if prefix == "vllm" else ""
    success = (
        f'{prefix}:request_success_total{{{labels}finished_reason="length",model_name="tiny"}}'
    )
    assert f"{success} 1.0" in text.splitlines(), text
    # a finished request's phases, as vLLM measures them
    assert f"{prefix}:request_prefill_time_seconds_sum" in text
    for name, value in (
        ("request_queue_time_seconds_sum", 0.5),
        ("request_prefill_time_seconds_sum", 0.5),
        ("request_decode_time_seconds_sum", 2.0),
        ("request_inference_time_seconds_sum", 2.5),
        ("request_time_per_output_token_seconds_sum", 0.5),
        ("request_generation_tokens_sum", 5.0),
        ("request_prompt_tokens_sum", 3.0),
    ):
        line = next(x for x in text.splitlines() if x.startswith(f"{prefix}:{name}"))
        assert float(line.rsplit(" ", 1)[1]) == value, line
