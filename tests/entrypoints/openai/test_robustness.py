"""The server keeps serving whatever one request does.

Each test triggers one way a request used to (or could) put the server out of service,
through a real ``pagedllm serve`` with a fault-injecting plugin installed as users
install plugins (``fault_plugin.py``), then checks that the trigger got a clear 4xx (or
fails alone) and that a normal request still succeeds and ``/health`` is 200.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import clean_env
from fault_plugin import FAIL_OUTPUT, FAIL_STEP, KILL_LOOP, install
from openai_server import (
    REQUEST_TIMEOUT,
    RemoteServer,
    assert_openai_error,
    start_servers,
    tiny_llama,
)

MODEL = "tiny"
API_KEY = "sk-robust"
COMPILE_TIMEOUT = 8
COMPILE_MEMORY_MIB = 200
MAX_SEQUENCES = 8


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("robustness")


def fault_env(workdir: Path, name: str) -> tuple[dict[str, str], Path]:
    """The environment of a server with the fault plugin, and where its faults write."""
    site = install(workdir / f"site_{name}")
    faults = workdir / f"faults_{name}"
    faults.mkdir()
    pythonpath = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return clean_env(PYTHONPATH=pythonpath, FAULT_DIR=str(faults)), faults


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, workdir: Path):
    model = tiny_llama(tmp_path_factory)
    env, faults = fault_env(workdir, "main")
    main = RemoteServer(
        model,
        "--served-model-name",
        MODEL,
        "--max-num-seqs",
        "4",
        "--max-sequences-per-request",
        str(MAX_SEQUENCES),
        "--guided-decoding-compile-timeout",
        str(COMPILE_TIMEOUT),
        "--guided-decoding-compile-memory",
        str(COMPILE_MEMORY_MIB),
        "--guided-decoding-disable-fallback",
        "--enable-log-requests",
        log_path=workdir / "main.log",
        env=env,
    )
    main.faults = faults  # type: ignore[attr-defined]
    keyed_env, _ = fault_env(workdir, "keyed")
    keyed = RemoteServer(
        model,
        "--api-key",
        API_KEY,
        "--disable-fastapi-docs",
        log_path=workdir / "keyed.log",
        env=keyed_env,
    )
    start_servers(main, keyed)
    yield main, keyed
    for server in (main, keyed):
        server.stop()


@pytest.fixture(scope="module")
def server(servers) -> RemoteServer:
    return servers[0]


@pytest.fixture(scope="module")
def keyed(servers) -> RemoteServer:
    return servers[1]


def assert_serving(server: RemoteServer) -> None:
    """``/health`` is 200 and a normal request succeeds."""
    with server.http() as h:
        assert h.get("/health").status_code == 200
        reply = h.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3 or reply.json()["choices"]
    assert "the engine loop died" not in server.log_text()


def wait_idle(server: RemoteServer, timeout: float = 30) -> tuple[float, float]:
    deadline = time.monotonic() + timeout
    while True:
        busy = server.metric("pagedllm:num_requests_running") + server.metric(
            "pagedllm:num_requests_waiting"
        )
        usage = server.metric("pagedllm:kv_cache_usage_perc")
        if (busy == 0 and usage == 0) or time.monotonic() > deadline:
            return busy, usage
        time.sleep(0.05)


def post_raw(server: RemoteServer, path: str, body: str, **kwargs) -> httpx.Response:
    with server.http() as h:
        return h.post(path, content=body, headers={"Content-Type": "application/json"}, **kwargs)


# ------------------------------------------------------------------- the engine loop


def test_multi_prompt_request_with_a_bad_prompt_queues_none(server: RemoteServer) -> None:
    body = {"model": MODEL, "prompt": ["a", "", "b", "c"], "max_tokens": 4}
    with server.http() as h:
        for _ in range(2):  # twice: the first used to kill the engine on the second
            assert_openai_error(h.post("/v1/completions", json=body), 400, "empty")
        good = h.post("/v1/completions", json={**body, "prompt": ["a", "b", "c"]})
        assert good.status_code == 200, good.text
        assert len(good.json()["choices"]) == 3
    assert wait_idle(server) == (0, 0)
    assert_serving(server)


def test_clients_giving_up_under_load(server: RemoteServer) -> None:
    """Clients that give up at every stage (queued for the engine thread, waiting for a
    batch slot, streaming) cost nothing: all KV blocks come back."""

    async def one(client: httpx.AsyncClient, index: int) -> None:
        body = {"model": MODEL, "prompt": f"load {index}", "max_tokens": 48, "stream": index % 2}
        body["ignore_eos"] = True
        timeout = 0.02 + (index % 12) * 0.1
        try:
            await asyncio.wait_for(client.post("/v1/completions", json=body), timeout)
        except (TimeoutError, httpx.HTTPError):
            pass

    async def load() -> None:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            await asyncio.gather(*(one(client, i) for i in range(64)))

    asyncio.run(load())
    assert wait_idle(server) == (0, 0)
    assert_serving(server)


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(server: RemoteServer) -> None:
    with server.http() as h:
        body = {"model": MODEL, "prompt": [*FAIL_STEP, 5, 6], "max_tokens": 4}
        error = assert_openai_error(h.post("/v1/completions", json=body), 500)
        assert "injected step failure" in error["message"]
    assert wait_idle(server) == (0, 0)
    assert_serving(server)


def test_an_output_failure_fails_that_request_alone(server: RemoteServer) -> None:
    with server.http() as h:
        body = {"model": MODEL, "prompt": "steady", "max_tokens": 40, "stream": True}
        with h.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # running: it shares the next steps
            bad = {"model": MODEL, "prompt": [*FAIL_OUTPUT, 7], "max_tokens": 4}
            error = assert_openai_error(h.post("/v1/completions", json=bad), 500)
            assert "injected output failure" in error["message"]
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert_serving(server)


def test_engine_loop_death_exits_non_zero(workdir: Path, tmp_path_factory) -> None:
    env, _ = fault_env(workdir, "dying")
    dying = RemoteServer(
        tiny_llama(tmp_path_factory),
        "--served-model-name",
        MODEL,
        log_path=workdir / "dying.log",
        env=env,
    )
    start_servers(dying)
    try:
        with dying.http() as h:
            body = {"model": MODEL, "prompt": [*KILL_LOOP, 1], "max_tokens": 4}
            assert_openai_error(h.post("/v1/completions", json=body), 503, "engine")
        assert dying.proc is not None
        code = dying.proc.wait(timeout=60)  # exits by itself, for a supervisor to restart
        assert code not in (0, None), dying.log_text()
        assert "the engine loop died" in dying.log_text()
    finally:
        dying.stop()


# ------------------------------------------------------------------ hostile inputs


BAD_REQUESTS = [
    ("/v1/completions", '{"prompt": "a\\ud800b"}', "surrogate"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\udfff"}]}', "surr"),
    ("/tokenize", '{"prompt": "a\\ud800b"}', "surrogate"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
    ("/v1/completions", '{"prompt": "a", "temperature": NaN}', "finite"),
    ("/v1/completions", '{"prompt": "a", "temperature": Infinity}', "finite"),
    ("/v1/completions", '{"prompt": "a", "temperature": 1e999}', "finite"),
    ("/v1/completions", '{"prompt": "a", "top_p": NaN}', "finite"),
    ("/v1/completions", '{"prompt": "a", "logit_bias": {"3": -Infinity}}', "finite"),
    ("/v1/completions", '{"prompt": "a", "stop_token_ids": [100000]}', "stop_token_ids"),
    ("/v1/completions", '{"prompt": "a", "stop_token_ids": [-1]}', "stop_token_ids"),
    ("/v1/completions", '{"prompt": "a", "bad_words": [""]}', "bad_words[0]"),
    ("/v1/completions", '{"prompt": "a", "bad_words": ["ok", "   "]}', "bad_words[1]"),
    (
        "/v1/completions",
        '{"prompt": ["a", "b", "c"], "n": 3, "temperature": 1}',
        "max-sequences-per-request",
    ),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], "n": 9}', "9"),
    ("/v1/completions", json.dumps({"prompt": "a", "request_id": "r" * 300}), "256"),
    ("/v1/completions", json.dumps({"prompt": "a", "request_id": "a\nb"}), "request_id"),
    # Token ids are JSON integers: not booleans, floats or strings read as ids.
    ("/detokenize", '{"tokens": [true, true]}', "tokens.0"),
    ("/detokenize", '{"tokens": [1.0]}', "integer"),
    ("/detokenize", '{"tokens": [5, "1"]}', "tokens.1"),
    ("/v1/completions", '{"prompt": [true, true]}', "token ids must be integers"),
    ("/v1/completions", '{"prompt": [[3, 2.0]]}', "token ids must be integers"),
    ("/v1/completions", '{"prompt": "a", "stop_token_ids": [true]}', "stop_token_ids"),
    ("/v1/completions", '{"prompt": "a", "allowed_token_ids": ["3"]}', "allowed_token_ids"),
]


# An external $ref (a file or URL on the server) is refused by name, whatever the backend
# and whichever field carries the schema.
EXTERNAL_REFS = [
    ("/v1/completions", {"prompt": "a", "guided_json": {"$ref": "file:///etc/passwd"}}),
    (
        "/v1/completions",
        {
            "prompt": "a",
            "guided_json": {"$ref": "file:///etc/passwd"},
            "guided_decoding_backend": "xgrammar",
        },
    ),
    (
        "/v1/completions",
        {
            "prompt": "a",
            "guided_json": {"$ref": "file:///etc/passwd"},
            "guided_decoding_backend": "outlines",
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "a"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$ref": "file:///etc/passwd"}},
            },
        },
    ),
    (
        "/v1/completions",
        {
            "prompt": "a",
            "structured_outputs": {
                "json": {"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}}
            },
        },
    ),
    (
        "/v1/completions",
        {"prompt": "a", "guided_json": {"anyOf": [{"$ref": "file:///etc/passwd#/x"}]}},
    ),
]


@pytest.mark.parametrize(("path", "body", "needle"), BAD_REQUESTS)
def test_bad_input_is_a_400(server: RemoteServer, path: str, body: str, needle: str) -> None:
    assert_openai_error(post_raw(server, path, body), 400, needle)
    with server.http() as h:
        assert h.get("/health").status_code == 200


@pytest.mark.parametrize(("path", "body"), EXTERNAL_REFS)
def test_an_external_ref_is_refused(server: RemoteServer, path: str, body: dict) -> None:
    with server.http() as h:
        reply = h.post(path, json={"model": MODEL, "max_tokens": 5, **body})
    assert_openai_error(reply, 400, "$ref 'file:///etc/passwd")


def test_an_external_ref_is_never_fetched(server: RemoteServer) -> None:
    """A URL $ref is refused without a connection to it; local refs still work."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/schema.json"
    try:
        for backend in (None, "outlines", "xgrammar"):
            body = {"model": MODEL, "prompt": "a", "max_tokens": 5, "guided_json": {"$ref": url}}
            if backend is not None:
                body["guided_decoding_backend"] = backend
            with server.http() as h:
                assert_openai_error(h.post("/v1/completions", json=body), 400, url)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    local = {
        "$defs": {"flag": {"type": "boolean"}},
        "type": "object",
        "properties": {"ok": {"$ref": "#/$defs/flag"}},
        "required": ["ok"],
    }
    body = {"model": MODEL, "prompt": "a", "max_tokens": 30, "guided_json": local}
    with server.http() as h:
        reply = h.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    if reply.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(reply.json()["choices"][0]["text"])["ok"], bool)


def test_logit_bias_past_float32_is_clamped(server: RemoteServer) -> None:
    """A bias past float32's range (1e39) is clamped to 100, as vLLM does: it forces the
    token in sampled and greedy rows alike, with finite logprobs."""
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 4,
        "logit_bias": {"5": 1e39},
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
    }
    with server.http() as h:
        for temperature in (1.0, 0.0):
            reply = h.post("/v1/completions", json={**body, "temperature": temperature})
            assert reply.status_code == 200, reply.text
            logprobs = reply.json()["choices"][0]["logprobs"]
            assert logprobs["tokens"] == ["token_id:5"] * 4, (temperature, logprobs)
            assert all(-100 < value <= 0 for value in logprobs["token_logprobs"]), logprobs
            # ... and -1e39 forbids it
            forbid = {**body, "temperature": temperature, "logit_bias": {"5": -1e39}}
            reply = h.post("/v1/completions", json=forbid)
            assert "token_id:5" not in reply.json()["choices"][0]["logprobs"]["tokens"]


def test_after_the_bad_inputs_the_server_serves(server: RemoteServer) -> None:
    assert wait_idle(server) == (0, 0)
    assert_serving(server)


def test_x_request_id_is_limited(server: RemoteServer) -> None:
    with server.http() as h:
        body = {"model": MODEL, "prompt": "a", "max_tokens": 2}
        long = h.post("/v1/completions", json=body, headers={"X-Request-Id": "x" * 300})
        assert_openai_error(long, 400, "X-Request-Id")
        ok = h.post("/v1/completions", json=body, headers={"X-Request-Id": "fine-id"})
        assert ok.status_code == 200 and ok.json()["id"] == "cmpl-fine-id"


def test_a_refused_request_is_not_logged(server: RemoteServer) -> None:
    """--enable-log-requests logs what the engine accepted; a refused request's contents
    never reach the log, however far it got (model, sampling parameters, the context)."""
    refused = [
        {"prompt": "refused-by-context qzx-refused", "max_tokens": 100000},
        {"prompt": "refused-by-params qzx-refused", "temperature": -1},
        {"prompt": "refused-by-vocab qzx-refused", "logit_bias": {"99999": 1}},
        {"prompt": "refused-by-guided qzx-refused", "guided_json": {"$ref": "file:///x"}},
        {"messages": [{"role": "user", "content": "refused-chat qzx-refused"}], "n": 99},
    ]
    with server.http() as h:
        for body in refused:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            assert_openai_error(h.post(path, json={"model": MODEL, **body}), 400)
        ok = {"model": MODEL, "prompt": "accepted marker", "max_tokens": 2}
        assert h.post("/v1/completions", json=ok).status_code == 200
    deadline = time.monotonic() + 5
    while "accepted marker" not in server.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.log_text()
    assert "received request cmpl-" in log and "prompt: 'accepted marker'" in log
    assert "qzx-refused" not in log


def test_logged_requests_cannot_forge_log_lines(server: RemoteServer) -> None:
    forged = "real\nINFO 00:00:00 pagedllm.server: forged line \x1b[31mred"
    with server.http() as h:
        h.post("/v1/completions", json={"model": MODEL, "prompt": forged, "max_tokens": 2})
    time.sleep(0.3)
    log = server.log_text()
    assert "real\\nINFO 00:00:00 pagedllm.server: forged line \\x1b[31mred" in log
    assert "\nINFO 00:00:00 pagedllm.server: forged" not in log
    assert "\x1b[31mred" not in log


# ----------------------------------------------------- work that grows with the input


def _health_times(server: RemoteServer, stop: threading.Event, times: list[float]) -> None:
    with server.http() as h:
        while not stop.is_set():
            started = time.monotonic()
            assert h.get("/health").status_code == 200
            times.append(time.monotonic() - started)
            time.sleep(0.05)


def test_huge_prompt_is_refused_before_tokenizing(server: RemoteServer) -> None:
    prompt = "word " * 2_000_000  # 10 MB
    log_size = server.log_path.stat().st_size
    with server.http() as h:
        started = time.monotonic()
        reply = h.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert_openai_error(reply, 400, "characters long")
        assert time.monotonic() - started < 10
        chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
        assert_openai_error(h.post("/v1/chat/completions", json=chat), 400, "characters long")
        assert_openai_error(h.post("/tokenize", json={"prompt": prompt}), 400, "characters long")
    assert_serving(server)
    # Refused: not logged (the server logs requests, --enable-log-requests).
    assert server.log_path.stat().st_size - log_size < 20_000


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'x ' * 5000000 }}",
        "{% for i in range(100000) %}{{ 'abcdefgh' * 100 }}{% endfor %}",
        "{% set s = 'x' * 100 %}" + "{% set s = s ~ s %}" * 40 + "{{ s }}",
        "{{ 'x' | center(1000000000) }}",
        "{{ ('x' * 50000) | replace('x', 'y' * 50000) }}",
    ],
    ids=["repeat", "loop-output", "doubling", "center", "replace"],
)
def test_chat_template_output_is_limited(server: RemoteServer, template: str) -> None:
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template": template,
    }
    with server.http() as h:
        reply = h.post("/v1/chat/completions", json=chat)
        assert_openai_error(reply, 400, "the chat template")
        tokenize = {"messages": chat["messages"], "chat_template": template}
        assert_openai_error(h.post("/tokenize", json=tokenize), 400, "the chat template")
    assert_serving(server)


def test_a_slow_template_holds_up_nobody(server: RemoteServer) -> None:
    """A template that loops until its time limit renders off the event loop: /health
    and other requests are answered meanwhile."""
    loop = (
        "{% set r = range(500)|list %}"
        "{% for i in r %}{% for j in r %}{% for k in r %}{% endfor %}{% endfor %}{% endfor %}"
    )
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template": loop}
    result: dict[str, httpx.Response] = {}

    def slow() -> None:
        with server.http(timeout=120) as h:
            result["reply"] = h.post("/v1/chat/completions", json=chat)

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.5)
    with server.http() as h:
        for _ in range(3):
            started = time.monotonic()
            assert h.get("/health").status_code == 200
            reply = h.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            assert reply.status_code == 200
            assert time.monotonic() - started < 2.0
        assert thread.is_alive()  # the template still runs
    thread.join(120)
    assert_openai_error(result["reply"], 400, "took longer than")
    assert_serving(server)


# --------------------------------------------------------------- guided decoding


def _guided(regex: str, backend: str | None = None) -> dict:
    body = {"model": MODEL, "prompt": "g", "max_tokens": 4, "guided_regex": regex}
    if backend is not None:
        body["guided_decoding_backend"] = backend
    return body


def _pid_from(path: Path, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return int(path.read_text())


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_slow_compile_is_abandoned_while_others_compile(server: RemoteServer) -> None:
    result: dict[str, httpx.Response] = {}

    def slow() -> None:
        with server.http(timeout=120) as h:
            result["reply"] = h.post("/v1/completions", json=_guided("slow", "sleepy"))

    thread = threading.Thread(target=slow)
    thread.start()
    pid = _pid_from(server.faults / "sleepy.pid")  # type: ignore[attr-defined]
    with server.http() as h:  # a second worker compiles meanwhile
        reply = h.post("/v1/completions", json=_guided("(yes|no)", "xgrammar"))
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] in ("yes", "no")
    assert thread.is_alive()
    thread.join(120)
    error = assert_openai_error(result["reply"], 400, f"took longer than {COMPILE_TIMEOUT} s")
    assert "'slow'" in error["message"]  # names the constraint
    assert _gone(pid, 10)  # its worker was killed
    assert_serving(server)


def test_compile_over_its_memory_budget_is_abandoned(server: RemoteServer) -> None:
    with server.http(timeout=120) as h:
        reply = h.post("/v1/completions", json=_guided("hungry", "hungry"))
    assert_openai_error(reply, 400, f"more than {COMPILE_MEMORY_MIB} MiB")
    assert _gone(int((server.faults / "hungry.pid").read_text()), 10)  # type: ignore[attr-defined]
    assert_serving(server)


def _tree_rss(pid: int) -> int:
    process = psutil.Process(pid)
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


def test_regex_bomb_stays_within_a_gigabyte(server: RemoteServer) -> None:
    assert server.proc is not None
    with server.http(timeout=120) as h:
        fast = h.post("/v1/completions", json=_guided("a{1000000}"))  # xgrammar: lazily
        assert fast.status_code == 200, fast.text
        before = _tree_rss(server.proc.pid)
        peak = [before]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], _tree_rss(server.proc.pid))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            slow = h.post("/v1/completions", json=_guided("a{1000000}", "outlines"))
        finally:
            stop.set()
            watcher.join()
    assert_openai_error(slow, 400, "a{1000000}")
    assert peak[0] - before < 2**30
    assert_serving(server)


def test_disconnect_cancels_its_compile(server: RemoteServer) -> None:
    faults: Path = server.faults  # type: ignore[attr-defined]
    (faults / "sleepy.pid").unlink(missing_ok=True)

    async def give_up() -> int:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            task = asyncio.ensure_future(
                client.post("/v1/completions", json=_guided("cancel me", "sleepy"))
            )
            pid = await asyncio.to_thread(_pid_from, faults / "sleepy.pid")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return pid

    pid = asyncio.run(give_up())
    # Killed well before its time limit would have stopped it.
    assert _gone(pid, COMPILE_TIMEOUT / 2)
    assert_serving(server)


def test_sigterm_stops_promptly_during_a_compile(workdir: Path, tmp_path_factory) -> None:
    env, faults = fault_env(workdir, "sigterm")
    stopping = RemoteServer(
        tiny_llama(tmp_path_factory),
        "--served-model-name",
        MODEL,
        "--guided-decoding-compile-timeout",
        "120",
        log_path=workdir / "sigterm.log",
        env=env,
    )
    start_servers(stopping)
    try:
        replies: list[httpx.Response] = []

        def compile_forever() -> None:
            with stopping.http(timeout=120) as h:
                replies.append(h.post("/v1/completions", json=_guided("x", "sleepy")))

        thread = threading.Thread(target=compile_forever, daemon=True)
        thread.start()
        pid = _pid_from(faults / "sleepy.pid")
        assert stopping.proc is not None
        started = time.monotonic()
        stopping.proc.send_signal(signal.SIGTERM)
        assert stopping.proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 8  # uvicorn's graceful wait is 10 s
        assert _gone(pid, 5)
        thread.join(10)
        assert replies and replies[0].status_code == 503
    finally:
        stopping.stop()


# ------------------------------------------------------------- routes and the schema


def test_openapi_documents_the_400_it_returns(server: RemoteServer) -> None:
    with server.http() as h:
        schema = h.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses
        body = responses["400"]["content"]["application/json"]["schema"]
        assert body == {"$ref": "#/components/schemas/ErrorResponse"}
    error = schema["components"]["schemas"]["ErrorResponse"]
    assert error["required"] == ["error"]
    # ... and it is what a 400 really looks like
    assert_openai_error(post_raw(server, "/v1/completions", '{"prompt": 5}'), 400)


# Bodies the server refuses (400) that the schema once allowed (the fuzzer's finds), and
# valid ones beside them, so that the check can fail either way.
SCHEMA_AGREEMENT = [
    ("/v1/completions", {"prompt": "a", "guided_choice": []}, False),
    ("/v1/completions", {"prompt": "a", "guided_choice": ["x"]}, True),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 2}, False),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, True),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "guided_choice": []},
        False,
    ),
    ("/tokenize", {"messages": []}, False),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}]}, True),
    ("/v1/completions", {"prompt": []}, False),
    ("/v1/completions", {"prompt": [[]]}, False),
    ("/v1/completions", {"prompt": [[1, 2]], "max_tokens": 2}, True),
    ("/v1/completions", {"prompt": [True, True], "max_tokens": 2}, False),
    ("/detokenize", {"tokens": [True, True]}, False),
    ("/detokenize", {"tokens": ["1"]}, False),
    ("/detokenize", {"tokens": [1, 2]}, True),
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": []}, False),
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": [3], "max_tokens": 2}, True),
    ("/v1/completions", {"prompt": "a", "best_of": 0}, False),
]


def test_openapi_schema_says_what_the_server_accepts(server: RemoteServer) -> None:
    """Where the server refuses a body for its shape, /openapi.json says so (minItems,
    integer token ids), so clients and fuzzers generate what is served."""
    import jsonschema

    with server.http() as h:
        schema = h.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    for name, field in [
        ("CompletionRequest", "allowed_token_ids"),
        ("CompletionRequest", "guided_choice"),
        ("ChatCompletionRequest", "guided_choice"),
        ("ChatCompletionRequest", "messages"),
        ("TokenizeRequest", "messages"),
    ]:
        prop = components[name]["properties"][field]
        arrays = [arm for arm in prop.get("anyOf", [prop]) if arm.get("type") == "array"]
        assert arrays and all(arm.get("minItems") == 1 for arm in arrays), (name, field, prop)
    prompt_arrays = [
        arm for arm in components["CompletionRequest"]["properties"]["prompt"]["anyOf"]
        if arm.get("type") == "array"
    ]  # fmt: skip
    assert len(prompt_arrays) == 3 and all(arm["minItems"] == 1 for arm in prompt_arrays)
    assert components["DetokenizeRequest"]["properties"]["tokens"]["items"] == {"type": "integer"}
    for path, body, valid in SCHEMA_AGREEMENT:
        body_schema = schema["paths"][path]["post"]["requestBody"]["content"]
        ref = body_schema["application/json"]["schema"]["$ref"]
        validator = jsonschema.Draft202012Validator(
            {"$ref": ref, "components": {"schemas": components}}
        )
        assert validator.is_valid(body) is valid, (path, body)
        reply = post_raw(server, path, json.dumps({"model": MODEL, **body}))
        if valid:
            assert reply.status_code == 200, (path, body, reply.text)
        else:
            assert_openai_error(reply, 400)


def test_api_key_routes(keyed: RemoteServer, tmp_path_factory) -> None:
    with httpx.Client(base_url=keyed.url, timeout=30) as h:  # no key
        assert h.get("/docs").status_code == 404  # --disable-fastapi-docs: no such route
        assert h.get("/openapi.json").status_code == 404
        assert h.get("/no/such/route").status_code == 404
        assert h.get("/health").status_code == 200
        # A route is open only if its path is an open one exactly, not by prefix.
        assert_openai_error(h.get("/health/details"), 401)
        assert_openai_error(h.get("/v1/models"), 401)
        metrics = h.get("/metrics")
        assert metrics.status_code == 200
        assert 'model_name="server_tiny_llama"' in metrics.text
        assert str(tiny_llama(tmp_path_factory)) not in metrics.text  # no filesystem paths
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=keyed.url, timeout=30, headers=headers) as h:
        assert h.get("/health/details").json() == {"secret": "only with the key"}
        assert h.get("/docs").status_code == 404


# Pydantic's messages for a value of the wrong type or length.
SHAPE_ERRORS = re.compile(r"Input should be a valid|should have at least \d+ item")


def test_schemathesis_finds_no_server_error(server: RemoteServer) -> None:
    """Requests generated from the schema against the documented routes: never a 5xx,
    never refused for a shape the schema allows, and the server is healthy afterwards."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    routes = {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
    }
    operations = [
        result.ok()
        for result in schema.get_all_operations()
        if result.ok().path in routes and result.ok().method.upper() == "POST"
    ]
    assert len(operations) == len(routes)
    failures: list[str] = []
    statuses: set[int] = set()

    def check_response(case) -> None:
        response = case.call(base_url=server.url, timeout=REQUEST_TIMEOUT)
        statuses.add(response.status_code)
        if response.status_code >= 500:
            failures.append(f"{case.path} {case.body!r}: {response.status_code} {response.text}")
        # The cases are valid by the schema: one refused for its shape (the checks the
        # schema carries) means the schema and the server disagree.
        elif response.status_code == 400 and SHAPE_ERRORS.search(response.text):
            failures.append(f"{case.path} {case.body!r}: the schema allows {response.text}")

    for operation in operations:
        # The boundary values of every field (empty lists, the ends of ranges), as the
        # schemathesis CLI's coverage phase sends them ...
        config = schema.config.generation_for(operation=operation)
        for case in schema.iter_coverage_cases(
            operation, generation_modes=[GenerationMode.POSITIVE], generation_config=config
        ):
            check_response(case)

        # ... and random ones.
        @settings(
            max_examples=75,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def check(case) -> None:
            check_response(case)

        check()
    assert not failures, "\n".join(failures[:5])
    assert {200, 400} <= statuses  # it reached the engine, and the validation
    assert wait_idle(server, timeout=120) == (0, 0)
    assert_serving(server)
