"""Sleep mode through ``pagedllm serve --enable-sleep-mode``: ``POST /sleep``,
``POST /wake_up``, ``GET /is_sleeping``; requests while asleep are a 503 (never a hang),
a stream running when the engine falls asleep ends (``mode=abort``) or completes first
(``mode=wait``), the server's resident memory falls, and without the flag the routes do
not exist."""

from __future__ import annotations

import threading
import time

import httpx
import psutil
import pytest
from openai_server import RemoteServer, assert_openai_error, start_servers, tiny_llama
from tiny_models import make_checkpoint

MODEL = "sleepy-llama"
PROMPT = [1, 5, 9, 12, 7, 3]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("sleep_server")
    # (~55 MB of float32 weights: their release is well above the noise of the RSS)
    big = make_checkpoint(
        tmp_path_factory.mktemp("sleep_server_llama"),
        "llama",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    sleepy = RemoteServer(
        big,
        "--enable-sleep-mode",
        "--served-model-name",
        MODEL,
        log_path=logs / "sleepy.log",
    )
    plain = RemoteServer(tiny_llama(tmp_path_factory), log_path=logs / "plain.log")
    start_servers(sleepy, plain)
    yield sleepy, plain
    sleepy.stop()
    plain.stop()


def _complete(h: httpx.Client, max_tokens: int = 8) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    return h.post("/v1/completions", json=body)


def _stream_lines(h: httpx.Client, max_tokens: int, first: threading.Event, out: list) -> None:
    """A streamed completion's events (``out``); ``first`` is set at its first token."""
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with h.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(httpx.Response(200, content=line[6:]).json())
                first.set()
            elif line == "data: [DONE]":
                out.append("[DONE]")


def _finish_reason(events: list) -> str | None:
    reasons = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict)]
    return [r for r in reasons if r is not None][-1] if any(reasons) else None


def test_sleep_and_wake_up(servers):
    server, _ = servers
    process = psutil.Process(server.proc.pid)
    with server.http() as h:
        before = _complete(h).json()["choices"][0]["text"]
        assert h.get("/is_sleeping").json() == {"is_sleeping": False}
        awake = process.memory_info().rss
        assert h.post("/sleep", params={"level": 1}).json() == {"status": "sleeping", "level": 1}
        asleep = process.memory_info().rss
        assert awake - asleep >= 0.8 * 50 * 2**20, (awake, asleep)
        assert h.get("/is_sleeping").json() == {"is_sleeping": True}
        assert h.get("/health").status_code == 200
        assert server.metric("pagedllm:engine_sleep_state", sleep_state="weights_offloaded") == 1
        assert server.metric("pagedllm:engine_sleep_state", sleep_state="awake") == 0
        assert_openai_error(_complete(h), 503, "POST /wake_up")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        assert_openai_error(h.post("/v1/chat/completions", json=chat), 503, "sleeping")
        assert h.post("/wake_up").json() == {"status": "awake", "tags": None}
        assert server.metric("pagedllm:engine_sleep_state", sleep_state="awake") == 1
        assert _complete(h).json()["choices"][0]["text"] == before
        # Level 2, woken tag by tag.
        assert h.post("/sleep?level=2").json() == {"status": "sleeping", "level": 2}
        assert server.metric("pagedllm:engine_sleep_state", sleep_state="discard_all") == 1
        reply = h.post("/wake_up", params={"tags": "weights"}).json()
        assert reply == {"status": "sleeping", "tags": ["weights"]}
        assert_openai_error(_complete(h), 503, "sleeping")
        reply = h.post("/wake_up", params={"tags": "kv_cache"}).json()
        assert reply == {"status": "awake", "tags": ["kv_cache"]}
        assert _complete(h).json()["choices"][0]["text"] == before


def test_bad_sleep_and_wake_up_arguments(servers):
    server, _ = servers
    with server.http() as h:
        assert_openai_error(h.post("/sleep?level=3"), 400, "levels are 1 and 2")
        assert_openai_error(h.post("/sleep?mode=keep"), 400, "abort, wait")
        assert_openai_error(h.post("/wake_up?tags=bogus"), 400, "'bogus'")
        assert h.get("/is_sleeping").json() == {"is_sleeping": False}


def test_sleep_during_a_stream_aborts_it(servers):
    server, _ = servers
    with server.http() as h, server.http() as control:
        first, events = threading.Event(), []
        thread = threading.Thread(target=_stream_lines, args=(h, 200, first, events))
        thread.start()
        assert first.wait(120)
        assert control.post("/sleep").json() == {"status": "sleeping", "level": 1}
        thread.join(60)
        assert not thread.is_alive()
        assert _finish_reason(events) == "abort"
        assert events[-1] == "[DONE]"
        assert control.post("/wake_up").json()["status"] == "awake"
        assert _complete(control).status_code == 200


def test_sleep_mode_wait_lets_the_stream_finish(servers):
    server, _ = servers
    with server.http() as h, server.http() as control:
        first, events = threading.Event(), []
        thread = threading.Thread(target=_stream_lines, args=(h, 240, first, events))
        thread.start()
        assert first.wait(120)
        replies: list = []
        sleeper = threading.Thread(
            target=lambda: replies.append(control.post("/sleep?mode=wait&level=1"))
        )
        sleeper.start()
        # New requests are refused at once while the running stream goes on.
        deadline = time.monotonic() + 60
        while (refused := _complete(h)).status_code != 503:
            assert time.monotonic() < deadline, refused.text
        assert thread.is_alive() and not replies
        assert_openai_error(refused, 503, "sleeping")
        thread.join(120)
        sleeper.join(120)
        assert _finish_reason(events) == "length"
        assert replies[0].json() == {"status": "sleeping", "level": 1}
        assert h.get("/is_sleeping").json() == {"is_sleeping": True}
        assert h.post("/wake_up").json()["status"] == "awake"
        assert _complete(h).status_code == 200


def test_routes_only_with_the_flag(servers):
    _, plain = servers
    with plain.http() as h:
        assert h.post("/sleep").status_code == 404
        assert h.post("/wake_up").status_code == 404
        assert h.get("/is_sleeping").status_code == 404
        assert "engine_sleep_state" not in httpx.get(plain.url + "/metrics").text
