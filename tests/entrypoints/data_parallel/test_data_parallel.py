"""Data parallelism: ``serve -dp 2`` runs two engine replica processes behind the front
end, ``--api-server-count 2`` two front-end processes on one port (with two replicas, and
with one engine process). Greedy tokens equal transformers' through the official client
(completions, chat, streaming); concurrent requests reach both replicas (their own
counters in ``/metrics``); an invalid request is a 400 and the next one is served; a
replica that dies makes the server answer 503 and exit non-zero, leaving no process
behind; what data parallelism cannot do is refused by name."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
import torch
from conftest import clean_env, run_cli
from openai_server import (
    BASE_ARGS,
    RemoteServer,
    assert_openai_error,
    free_port,
    start_servers,
    tiny_llama,
)
from tiny_models import load_reference, reference_greedy

from pagedllm import LLM, EngineArgs
from pagedllm.core.errors import ConfigError

NEW_TOKENS = 6
SERVERS = {
    "dp2": ("-dp", "2"),
    # (and vLLM's metric names: the replicas' metrics merged by each front end)
    "dp2-asc2": ("-dp", "2", "--api-server-count", "2", "--metrics-prefix", "vllm"),
    "dp1-asc2": ("-asc", "2"),
}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(6, 512, (n,), generator=g).tolist() for n in (4, 9, 13)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(tmp_path_factory)


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    """The three layouts, started together (they load at the same time)."""
    logs = tmp_path_factory.mktemp("dp_logs")
    started = {
        name: RemoteServer(model, *args, log_path=logs / f"{name}.log")
        for name, args in SERVERS.items()
    }
    start_servers(*started.values())
    yield started
    for server in started.values():
        server.stop()


def _replica_pids(server: RemoteServer) -> list[int]:
    """The replicas' process ids, as the server logs them."""
    match = re.search(r"engine replicas \(processes ([\d, ]+)\)", server.log_text())
    assert match, server.log_text()
    return [int(pid) for pid in match.group(1).split(", ")]


def test_greedy_tokens_equal_transformers_in_every_layout(servers, model):
    reference = load_reference(model)
    prompts = _prompts()
    expected = [reference_greedy(reference, p, NEW_TOKENS)[0] for p in prompts]
    chats = {}
    for name, server in servers.items():
        client = server.client()
        for prompt, tokens in zip(prompts, expected, strict=True):
            completion = client.completions.create(
                model=str(model), prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                logprobs=1, extra_body={"return_tokens_as_token_ids": True},
            )  # fmt: skip
            ids = [int(t.removeprefix("token_id:")) for t in completion.choices[0].logprobs.tokens]
            assert ids == tokens, name
        text = (
            client.completions.create(
                model=str(model), prompt=prompts[0], max_tokens=NEW_TOKENS, temperature=0
            )
            .choices[0]
            .text
        )
        stream = client.completions.create(
            model=str(model), prompt=prompts[0], max_tokens=NEW_TOKENS, temperature=0,
            stream=True,
        )  # fmt: skip
        assert "".join(chunk.choices[0].text for chunk in stream) == text, name
        messages = [{"role": "user", "content": "Say something."}]
        chat = client.chat.completions.create(
            model=str(model), messages=messages, max_tokens=NEW_TOKENS, temperature=0
        )
        streamed = client.chat.completions.create(
            model=str(model), messages=messages, max_tokens=NEW_TOKENS, temperature=0,
            stream=True,
        )  # fmt: skip
        pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
        assert "".join(pieces) == chat.choices[0].message.content, name
        chats[name] = chat.choices[0].message.content
    assert len(set(chats.values())) == 1, chats


async def _concurrent(server: RemoteServer, model: str, count: int) -> None:
    client = server.async_client()
    await asyncio.gather(
        *(
            client.completions.create(model=model, prompt=p, max_tokens=NEW_TOKENS)
            for p in _prompts() * (count // 3)
        )
    )


@pytest.mark.parametrize("name", ["dp2", "dp2-asc2"])
def test_concurrent_requests_reach_both_replicas(servers, model, name):
    server = servers[name]
    prefix = "vllm" if "--metrics-prefix" in SERVERS[name] else "pagedllm"
    success = f"{prefix}:request_success_total"
    before = [server.metric(success, engine=str(i)) for i in (0, 1)]
    asyncio.run(_concurrent(server, str(model), 6))
    after = [server.metric(success, engine=str(i)) for i in (0, 1)]
    done = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(done) == 6 and min(done) >= 1, done
    # Either front end answers for every replica.
    prompt_tokens = server.metric(f"{prefix}:prompt_tokens_total")
    assert prompt_tokens >= sum(len(p) for p in _prompts()) * 2


def test_reset_prefix_cache_is_refused_with_replicas(servers):
    response = httpx.post(servers["dp2"].url + "/reset_prefix_cache", timeout=30)
    assert_openai_error(response, 501, "--data-parallel-size above 1")


@pytest.mark.parametrize("name", list(SERVERS))
def test_an_invalid_request_is_a_400_and_the_server_goes_on(servers, model, name):
    server = servers[name]
    with server.http() as http:
        body = {"model": str(model), "prompt": "Hello", "max_tokens": 2, "ignore_eos": True}
        # (refused by the replica's engine: this server's policy has no priorities)
        refused = http.post("/v1/completions", json={**body, "priority": 3})
        error = assert_openai_error(refused, 400, "priority")
        assert error["param"] == "priority"
        schema = http.post(
            "/v1/completions", json={**body, "guided_json": {"type": "no-such-type"}}
        )
        assert_openai_error(schema, 400)
        served = http.post("/v1/completions", json=body)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 2


def test_refusals_name_the_flag(pm, model):
    with pytest.raises(ConfigError, match=r"--data-parallel-size 2: .*pagedllm serve"):
        LLM(str(model), dtype="float32", data_parallel_size=2)
    with pytest.raises(ConfigError, match="--data-parallel-size=0 is invalid"):
        from pagedllm.core.config import UsageContext, _check_data_parallel

        config = EngineArgs(model=str(model), data_parallel_size=0).create_engine_config(pm)
        _check_data_parallel(config, UsageContext.OPENAI_API_SERVER)
    commands = {
        ("bench", "throughput", "--model", str(model), "-dp", "2"): "--data-parallel-size 2",
        ("serve", str(model), "--headless"): "--headless runs data-parallel replicas",
        ("serve", str(model), "-dpa", "10.0.0.1"): (
            "--data-parallel-address applies with --data-parallel-size above 1"
        ),
        ("serve", str(model), "-dp", "2", "-dpl", "1"): "set PAGEDLLM_DATA_PARALLEL_KEY",
        ("serve", str(model), "-dp", "2", "-dpl", "3"): "--data-parallel-size-local=3",
        ("serve", str(model), "-dp", "2", "-dpr", "1"): "--data-parallel-start-rank applies",
        ("serve", str(model), "--headless", "-dp", "2", "-dpr", "1"): (
            "--headless needs --data-parallel-address"
        ),
        ("serve", str(model), "--api-server-count", "0"): "--api-server-count=0 is invalid",
        ("serve", str(model), "-asc", "2", "--enable-server-load-tracking"): (
            "--enable-server-load-tracking"
        ),
        ("serve", str(model), "-dp", "2", "--disable-frontend-multiprocessing"): (
            "--disable-frontend-multiprocessing: with --data-parallel-size 2 each replica's"
        ),
        ("serve", str(model), "-asc", "2", "--disable-frontend-multiprocessing"): (
            "--disable-frontend-multiprocessing: --api-server-count 2 runs"
        ),
        ("serve", str(model), "--headless", "--disable-frontend-multiprocessing"): (
            "--disable-frontend-multiprocessing: a --headless node runs no API server"
        ),
    }
    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        results = dict(zip(commands, pool.map(lambda c: run_cli(*c), commands), strict=True))
    for command, message in commands.items():
        result = results[command]
        assert result.returncode == 2 and message in result.stderr, (command, result.stderr)


def test_replicas_on_two_nodes(model, tmp_path):
    """A head node with replica 0 and a --headless node with replica 1 (both on this
    machine, over loopback): the head serves once replica 1 has registered, requests
    reach both (transformers' tokens), and the headless node stops with the head (0)."""
    port = free_port()
    env = clean_env(PAGEDLLM_DATA_PARALLEL_KEY="a shared secret", PAGEDLLM_HOST_IP="127.0.0.1")
    nodes = ("-dp", "2", "-dpa", "127.0.0.1", "-dpp", str(port))
    head = RemoteServer(model, *nodes, "-dpl", "1", log_path=tmp_path / "head.log", env=env)
    command = [
        sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", str(model),
        *BASE_ARGS, *nodes, "--headless", "-dpr", "1",
    ]  # fmt: skip
    with (tmp_path / "headless.log").open("wb") as log:
        headless = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        start_servers(head)
        reference = load_reference(model)
        prompt = _prompts()[1]
        completion = head.client().completions.create(
            model=str(model), prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
            logprobs=1, extra_body={"return_tokens_as_token_ids": True},
        )  # fmt: skip
        ids = [int(t.removeprefix("token_id:")) for t in completion.choices[0].logprobs.tokens]
        assert ids == reference_greedy(reference, prompt, NEW_TOKENS)[0]
        asyncio.run(_concurrent(head, str(model), 6))
        done = [head.metric("pagedllm:request_success_total", engine=str(i)) for i in (0, 1)]
        assert sum(done) == 7 and min(done) >= 1, done
        assert "data-parallel replicas [1] registered" in head.log_text()
        assert head.stop() == 0
        assert headless.wait(60) == 0
        assert "the head node stopped" in (tmp_path / "headless.log").read_text()
    finally:
        head.stop()
        if headless.poll() is None:
            headless.kill()


def test_the_head_node_takes_only_the_replicas_it_lacks():
    """Registrations at the head node: another key, data-parallel size, model or a
    replica already taken are refused, and so is a node once every replica has
    registered; a connection that says nothing holds up no one; the nodes registered
    are kept, and told to stop."""
    import types
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    import transformers

    from pagedllm.core.sampling.defaults import SamplingDefaults
    from pagedllm.entrypoints.data_parallel.replica import EngineFacts, LoadedFacts
    from pagedllm.entrypoints.data_parallel.replica_nodes import RemoteReplicas, fingerprint

    def facts(layers: int) -> EngineFacts:
        config = transformers.LlamaConfig(num_hidden_layers=layers)
        loaded = LoadedFacts(SamplingDefaults(), (2,), config)
        return EngineFacts(None, 64, 512, "generate", {}, loaded)

    port = free_port()
    parallel = types.SimpleNamespace(
        data_parallel_size=3, data_parallel_address="127.0.0.1", data_parallel_rpc_port=port
    )
    remote = RemoteReplicas(parallel, b"key", 1)
    found: list[dict] = []
    waiting = threading.Thread(
        target=lambda: found.append(remote.wait(facts(2), time.monotonic() + 60, lambda: None))
    )
    waiting.start()
    ours, theirs = fingerprint(facts(2)), fingerprint(facts(3))

    def register(*message, key=b"key"):
        conn = Client(("127.0.0.1", port), authkey=key)
        conn.send(("register", *message))
        return conn, conn.recv()

    silent = socket.create_connection(("127.0.0.1", port))  # (a port scanner, say)
    with pytest.raises(AuthenticationError):
        register(3, {1: "a"}, ours, key=b"other")
    for message, problem in [
        ((2, {1: "a"}, ours), "its --data-parallel-size is 2, the head node's 3"),
        ((3, {0: "a"}, ours), "its replica 0 is not one of the head node's others (1..2)"),
        ((3, {1: "a"}, theirs), "serve another model"),
    ]:
        assert problem in register(*message)[1][1]
    first, answer = register(3, {1: ("10.0.0.2", 5)}, ours)
    assert answer == ("ok",)
    assert "replica 1 is registered already" in register(3, {1: "b"}, ours)[1][1]
    second, answer = register(3, {2: ("10.0.0.3", 6)}, ours)
    waiting.join(30)
    assert found == [{1: ("10.0.0.2", 5), 2: ("10.0.0.3", 6)}]
    assert "registered already" in register(3, {2: "c"}, ours)[1][1]
    remote.stop()
    assert first.recv() == ("stop",) and second.recv() == ("stop",)
    silent.close()


def test_a_dead_replica_stops_the_server(servers):
    """(Last: it ends two of the servers.) A killed replica: /health answers 503, then the
    server exits non-zero, and none of its processes is left."""
    dying = [servers["dp2"], servers["dp2-asc2"]]
    family = {}
    for server in dying:
        assert server.proc is not None
        family[server.port] = psutil.Process(server.proc.pid).children(recursive=True)
        psutil.Process(_replica_pids(server)[1]).kill()
    statuses: dict[int, set[int]] = {server.port: set() for server in dying}
    deadline = time.monotonic() + 60
    while any(s.proc.poll() is None for s in dying) and time.monotonic() < deadline:
        for server in dying:
            try:
                statuses[server.port].add(httpx.get(server.url + "/health", timeout=5).status_code)
            except httpx.HTTPError:
                pass
        time.sleep(0.05)
    for server in dying:
        assert server.proc.returncode not in (None, 0), server.log_text()
        assert 503 in statuses[server.port], (statuses, server.log_text())
        assert "data-parallel replica 1 exited" in server.log_text()
        _, alive = psutil.wait_procs(family[server.port], timeout=30)
        assert not alive, alive


def test_a_group_aborted_or_dropped_at_once_leaves_no_load(model):
    """A request group aborted (or its front end gone) in the same loop iteration as it
    arrived, before its task ever ran, stops counting in the replica's load at once; a
    group that ran to its end too."""
    from multiprocessing.connection import Client, Listener

    from pagedllm.core.async_engine import AsyncLLMEngine
    from pagedllm.core.engine import NewRequest
    from pagedllm.core.plugins import make_plugin_manager
    from pagedllm.core.sampling import SamplingParams
    from pagedllm.entrypoints.data_parallel.replica import Replica, _Peer

    pm = make_plugin_manager()
    config = EngineArgs(model=str(model), dtype="float32", disable_log_stats=True)
    engine = AsyncLLMEngine(config.create_engine_config(pm), pm)
    listener = Listener(("127.0.0.1", 0), authkey=b"k")
    clients: list = []  # (the handshake needs both ends at once)
    connecting = threading.Thread(
        target=lambda: clients.append(Client(listener.address, authkey=b"k"))
    )
    connecting.start()
    accepted = listener.accept()
    connecting.join()
    replica = Replica(engine, 0)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)

    def group(ids: str) -> list[NewRequest]:
        return [NewRequest(i, {"prompt_token_ids": [5, 6, 7]}, params) for i in ids]

    async def run() -> list[int]:
        replica.loop = asyncio.get_running_loop()
        peer = _Peer(accepted)
        replica.peers.append(peer)
        loads = []
        replica.loop.call_soon(replica._handle, peer, ("add", 1, group("ab")))
        replica.loop.call_soon(replica._handle, peer, ("abort", 1))
        await asyncio.sleep(0.2)
        loads.append(sum(len(ids) for ids in replica._live.values()))
        replica._handle(peer, ("add", 2, group("c")))
        loads.append(sum(len(ids) for ids in replica._live.values()))
        await peer.groups[2]
        await asyncio.sleep(0)
        loads.append(sum(len(ids) for ids in replica._live.values()))
        replica.loop.call_soon(replica._handle, peer, ("add", 3, group("d")))
        replica.loop.call_soon(replica._drop, peer)
        await asyncio.sleep(0.2)
        loads.append(sum(len(ids) for ids in replica._live.values()))
        return loads

    try:
        assert asyncio.run(run()) == [0, 1, 0, 0]
        assert engine.engine.kv_manager.usage == 0.0
    finally:
        clients[0].close()
        listener.close()
        engine.shutdown()
