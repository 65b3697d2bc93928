"""Bounded work per non-streaming response (``--max-response-mb``): one over the limit is
refused with a 400 that names it and suggests ``stream=true`` — before generating when
even its smallest size is over, else while it grows (its generation stopped) — and a
large one is built and serialized off the event loop (``/health`` answers meanwhile),
its memory given back afterwards. Through the real server, on the tiny checkpoint."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import psutil
import pytest
from openai_server import RemoteServer, assert_openai_error, start_servers, tiny_llama

from pagedllm.entrypoints.openai.json_body import dumps

LIMIT_MB = "0.005"  # 5,242 bytes: a short reply fits, log probabilities of a few do not
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("response_limits")
    model = tiny_llama(tmp_path_factory)
    small = RemoteServer(model, "--max-response-mb", LIMIT_MB, log_path=logs / "small.log")
    # (the default limit, 64 MiB; KV blocks for 128 sequences of a 240-token prompt)
    default = RemoteServer(
        model,
        log_path=logs / "default.log",
        base_args=(
            "--dtype",
            "float32",
            "--disable-log-stats",
            "--num-gpu-blocks-override",
            "1024",
        ),
    )
    start_servers(small, default)
    yield small, default
    small.stop()
    default.stop()


def generated(server: RemoteServer) -> float:
    try:
        return server.metric("pagedllm:generation_tokens_total")
    except AssertionError:  # (not there before the first token)
        return 0.0


def assert_too_large(response: httpx.Response) -> None:
    error = assert_openai_error(response, 400, f"larger than {float(LIMIT_MB):g} MiB")
    assert "--max-response-mb" in error["message"] and "stream=true" in error["message"]
    assert error["param"] == "stream"


def test_over_the_limit_is_refused_and_the_server_keeps_serving(servers):
    server, _ = servers
    with server.http() as http:
        small = http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 5})
        assert small.status_code == 200, small.text
        # Refused before generating: 2 x 20 tokens for sure (ignore_eos), each with 20 log
        # probabilities, are more than 5 KB whatever the tokens.
        before = generated(server)
        sure = CHAT | {"n": 2, "max_tokens": 20, "ignore_eos": True, "logprobs": True}
        assert_too_large(http.post("/v1/chat/completions", json=sure | {"top_logprobs": 20}))
        assert generated(server) == before
        # Stopped while generating: the model may end early, so it is tried; past the limit
        # its sequences are aborted, far short of their 4 x 200 tokens.
        for path, body in (
            ("/v1/chat/completions", CHAT | {"logprobs": True, "top_logprobs": 20}),
            ("/v1/completions", {"prompt": "hi", "logprobs": 20}),
        ):
            before = generated(server)
            body = body | {"n": 4, "max_tokens": 200, "temperature": 1.0}
            assert_too_large(http.post(path, json=body))
            time.sleep(1.0)  # (a generation still running would go on counting)
            stopped = generated(server)
            assert stopped - before < 4 * 200 / 2, stopped - before
            time.sleep(1.0)
            assert generated(server) == stopped
            # The same as a stream is not limited.
            with http.stream("POST", path, json=body | {"stream": True}) as stream:
                assert stream.status_code == 200
                lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
        # /v1/responses: its body checked whole (metadata alone makes this one 8 KB).
        metadata = {f"k{i}": "v" * 500 for i in range(16)}
        ask = {"input": "hi", "max_output_tokens": 5}
        assert_too_large(http.post("/v1/responses", json=ask | {"metadata": metadata}))
        answer = http.post("/v1/responses", json=ask)
        assert answer.status_code == 200 and answer.json()["status"] in ("completed", "incomplete")
        small = http.post("/v1/chat/completions", json=CHAT | {"max_tokens": 5})
        assert small.status_code == 200, small.text


def test_large_response_does_not_block_the_event_loop(servers):
    """A 57 MB response: 128 choices, each with its prompt's 240 tokens' 20 log
    probabilities twice (echo and prompt_logprobs). Built and serialized on the event
    loop, /health waited 3-3.4 s for it on a 2-core machine (and the server kept 385 MB
    more); off the loop, under 0.4 s."""
    _, server = servers
    prompt = [5 + i % 50 for i in range(240)]
    body = {"prompt": prompt, "n": 128, "max_tokens": 1, "echo": True, "logprobs": 20}
    body["prompt_logprobs"] = 20
    process = psutil.Process(server.proc.pid)
    with server.http() as http:
        warm = http.post("/v1/completions", json=body | {"n": 2})
        assert warm.status_code == 200, warm.text
        time.sleep(1.0)
        resident = process.memory_info().rss
        latencies: list[float] = []
        done = threading.Event()

        def poll() -> None:
            with server.http(timeout=60) as probe:
                while not done.is_set():
                    start = time.monotonic()
                    assert probe.get("/health").status_code == 200
                    latencies.append(time.monotonic() - start)
                    time.sleep(0.02)

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            response = http.post("/v1/completions", json=body)
        finally:
            done.set()
            poller.join()
    assert response.status_code == 200, response.text[:1000]
    assert len(response.content) > 40_000_000
    choices = response.json()["choices"]
    assert len(choices) == 128 and all(len(c["prompt_logprobs"]) == 240 for c in choices)
    assert len(latencies) > 5 and max(latencies) < 2.0, max(latencies)
    time.sleep(2.0)
    grown = process.memory_info().rss - resident
    assert grown < 150 * 2**20, f"the server kept {grown / 2**20:.0f} MiB more"


def test_bodies_written_in_pieces_are_json_dumps():
    rng = random.Random(0)

    def token() -> dict:
        text = chr(rng.randrange(1, 0x3000)) + '"\\\n'
        top = [{"token": "x", "logprob": -rng.random(), "bytes": [255]} for _ in range(20)]
        return {"token": text, "logprob": -1e-5, "bytes": [1], "top_logprobs": top}

    content = {
        "choices": [
            {"index": i, "text": "héllo", "logprobs": {"content": [token() for _ in range(600)]}}
            for i in range(6)
        ],
        "ids": list(range(20_000)),
        "nested": [list(range(5000)), None, True, "a", 1.5],
        "int_keys": {1: "a"},
        "tuple": (1, 2),
        "empty": [[], {}],
    }
    for value in (content, [], {}, "x", [content["ids"]], {"k": content["choices"]}):
        expected = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        assert dumps(value) == expected.encode()
    with pytest.raises(ValueError):
        dumps({"x": [float("nan")] * 10_000})
