"""``--metrics-prefix vllm``: /metrics under vLLM's names, types and labels (the list of
vLLM 0.32's metrics is in tests/data/vllm_metrics_0_32.json), so that what reads vLLM's
metrics (its Grafana dashboard, alerts, autoscalers) reads pagedllm's."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai_server import RemoteServer, tiny_llama
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.entrypoints.metrics import VLLM_METRICS

VLLM = json.loads((Path(__file__).parents[2] / "data" / "vllm_metrics_0_32.json").read_text())[
    "metrics"
]
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("vllm-metrics") / "server.log"
    remote = RemoteServer(
        tiny_llama(tmp_path_factory),
        "--served-model-name",
        MODEL,
        "--metrics-prefix",
        "vllm",
        # (and vLLM's engine_sleep_state gauge)
        "--enable-sleep-mode",
        log_path=log,
    )
    remote.start().wait_ready()
    yield remote
    remote.stop()


def _families(server: RemoteServer) -> dict[str, object]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    # (prometheus-client's creation times of counters and histograms, vLLM's as ours)
    return {
        name: family
        for name, family in families.items()
        if not (name.endswith("_created") and name.removesuffix("_created") in families)
    }


def test_names_types_and_labels_are_vllms(server: RemoteServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120)
    client.completions.create(
        model=MODEL, prompt="vLLM names", max_tokens=5, extra_body={"ignore_eos": True}
    )
    families = _families(server)
    ours = {name.removeprefix("vllm:") for name in families if name.startswith("vllm:")}
    # every metric vLLM also has is exported under its vLLM name, and only those are
    assert ours == set(VLLM_METRICS)
    assert ours <= set(VLLM), sorted(ours - set(VLLM))
    for name in ours:
        family = families[f"vllm:{name}"]
        assert family.type == VLLM[name]["type"], name
        labels = {"model_name", "engine", *VLLM[name]["extra_labels"]}
        assert family.samples, name
        for sample in family.samples:
            have = set(sample.labels) - {"le"}
            assert have == labels, (name, sample)
            assert sample.labels["engine"] == "0" and sample.labels["model_name"] == MODEL
    # what vLLM does not have keeps its own name
    assert "pagedllm:prefix_cache_hit_rate" in families
    assert not any(
        name.removeprefix("pagedllm:") in VLLM_METRICS for name in families if "pagedllm:" in name
    )


def test_values_mean_what_vllms_do(server: RemoteServer) -> None:
    m = server.metric
    before = {
        name: m(name) if _present(server, name) else 0.0
        for name in (
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:inter_token_latency_seconds_count",
            "vllm:request_time_per_output_token_seconds_count",
            "vllm:request_generation_tokens_sum",
            "vllm:request_prompt_tokens_sum",
            "vllm:request_params_max_tokens_sum",
            "vllm:iteration_tokens_total_sum",
            "vllm:e2e_request_latency_seconds_count",
        )
    }
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120)
    # a prompt no other test sends: no prefix-cache hit
    response = client.completions.create(
        model=MODEL, prompt="zephyr quill 4471 ochre", max_tokens=9, extra_body={"ignore_eos": True}
    )
    prompt, generated = response.usage.prompt_tokens, response.usage.completion_tokens
    assert generated == 9

    def grew(name: str) -> float:
        return m(name) - before[name]

    assert grew("vllm:prompt_tokens_total") == prompt
    assert grew("vllm:generation_tokens_total") == generated
    # vLLM observes every gap between a request's tokens, and once per request their mean
    assert grew("vllm:inter_token_latency_seconds_count") == generated - 1
    assert grew("vllm:request_time_per_output_token_seconds_count") == 1
    assert grew("vllm:e2e_request_latency_seconds_count") == 1
    assert grew("vllm:request_generation_tokens_sum") == generated
    assert grew("vllm:request_prompt_tokens_sum") == prompt
    assert grew("vllm:request_params_max_tokens_sum") == 9
    # the prefill step computes the prompt, each later step one token
    assert grew("vllm:iteration_tokens_total_sum") == prompt + generated - 1
    assert m("vllm:num_requests_running") == 0
    assert m("vllm:kv_cache_usage_perc") == 0


def _present(server: RemoteServer, name: str) -> bool:
    return any(key.split("{")[0] == name for key in server.metrics())


def test_an_aborted_request_counts_as_finished_with_reason_abort(server: RemoteServer) -> None:
    """As vLLM's: a client that leaves mid-stream ends its request with reason "abort"."""

    def aborted() -> float:
        return (
            server.metric("vllm:request_success_total", finished_reason="abort")
            if _present_with(server, "vllm:request_success_total", 'finished_reason="abort"')
            else 0.0
        )

    before = aborted()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = {
            "model": MODEL,
            "prompt": "a long story",
            "max_tokens": 200,
            "stream": True,
            "ignore_eos": True,
        }
        with http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break  # (the first chunk: then the client goes)
    deadline = time.monotonic() + 60
    while aborted() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted() == before + 1


def _present_with(server: RemoteServer, name: str, label: str) -> bool:
    return any(key.split("{")[0] == name and label in key for key in server.metrics())
