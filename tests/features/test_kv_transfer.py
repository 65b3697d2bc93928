"""--kv-transfer-config (prefill/decode disaggregation): a producer engine saves its prompts'
full KV blocks through a connector, a consumer engine loads them instead of computing the
prompt; greedy outputs equal transformers' either way, and a block the consumer cannot load
is computed again."""

from __future__ import annotations

import json
import logging
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import clean_env, run_cli
from core.test_scheduler import BS, TOK, add, make_scheduler, step
from openai_server import RemoteServer, free_port, start_servers
from tiny_models import load_reference, make_checkpoint, reference_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.core.configs.kv_transfer import KVTransferConfig
from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces import KVBlockLayout, StepExtension
from pagedllm.core.plugins import make_plugin_manager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.features.kv_transfer import prompt_block_keys

BLOCK = 16
NEW_TOKENS = 8
REPO = Path(__file__).resolve().parents[2]


def transfer(role: str, path: Path | str) -> dict:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 200) for _ in range(length)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def reference(checkpoint):
    return load_reference(checkpoint)


def build(model: Path, **kwargs) -> LLM:
    return LLM(
        str(model),
        dtype="float32",
        num_gpu_blocks_override=64,
        block_size=BLOCK,
        disable_log_stats=True,
        **kwargs,
    )


@pytest.fixture(scope="module")
def pair(checkpoint, tmp_path_factory):
    """A producer and a consumer engine sharing a folder."""
    store = tmp_path_factory.mktemp("kv_store")
    producer = build(checkpoint, kv_transfer_config=transfer("kv_producer", store))
    consumer = build(checkpoint, kv_transfer_config=transfer("kv_consumer", store))
    return producer, consumer, store


def greedy(llm: LLM, tokens: list[int], max_tokens: int = NEW_TOKENS) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    output = llm.generate({"prompt_token_ids": tokens}, params, use_tqdm=False)[0]
    return list(output.outputs[0].token_ids)


def keys_of(tokens: list[int], llm: LLM) -> list[str]:
    layout = llm.llm_engine.extensions["kv_transfer"].layout
    return prompt_block_keys(Request("keys", tokens, SamplingParams()), BLOCK, layout.tag)


def checkpoint_keys(checkpoint: Path, tokens: list[int]) -> list[str]:
    """The keys of ``tokens``' blocks in a float32 engine of ``checkpoint``."""
    config = json.loads((checkpoint / "config.json").read_text())
    heads = config["num_attention_heads"]
    shape = (
        config["num_hidden_layers"],
        2,
        BLOCK,
        config.get("num_key_value_heads") or heads,
        config.get("head_dim") or config["hidden_size"] // heads,
    )
    tag = KVBlockLayout(shape, torch.float32).tag
    return prompt_block_keys(Request("keys", tokens, SamplingParams()), BLOCK, tag)


def counters(llm: LLM) -> tuple[int, int, int]:
    """(prompt tokens computed, connector tokens looked up, found) since the start."""
    engine = llm.llm_engine
    stats = engine.scheduler.extension_stats()
    return (
        engine.stat_logger.prompt_tokens,
        stats["kv_transfer_queries"],
        stats["kv_transfer_hits"],
    )


# ------------------------------------------------------------------------ the config


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"kv_role": "kv_producer"}, "'kv_connector'"),
        ({"kv_connector": "ExampleConnector"}, "kv_role None: choose one of"),
        ({"kv_connector": "ExampleConnector", "kv_role": "both"}, "kv_role 'both'"),
        (
            {"kv_connector": "X", "kv_role": "kv_both", "kv_ip": "1.2.3.4"},
            "unknown key(s) ['kv_ip']",
        ),
        (
            {"kv_connector": "X", "kv_role": "kv_both", "kv_load_failure_policy": "fail"},
            "kv_load_failure_policy='fail' is not supported",
        ),
        ({"kv_connector": "X", "kv_role": "kv_both", "kv_port": 5000}, "kv_port=5000"),
        (
            {"kv_connector": "X", "kv_role": "kv_both", "kv_buffer_device": "cuda"},
            "kv_buffer_device='cuda'",
        ),
        (
            {"kv_connector": "X", "kv_role": "kv_both", "kv_connector_module_path": "m"},
            "kv_connector_module_path='m'",
        ),
    ],
)
def test_config_refuses_what_it_does_not_do(values, message):
    with pytest.raises(ConfigError, match="--kv-transfer-config") as error:
        KVTransferConfig.from_dict(values)
    assert message in str(error.value)


def test_config_takes_vllm_defaults():
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_consumer",
            "kv_load_failure_policy": "recompute",
            "kv_buffer_device": "cpu",
            "engine_id": "decode-0",
        }
    )
    assert config.is_consumer and not config.is_producer


@pytest.mark.parametrize(
    ("sizes", "flag"),
    [
        ({"tensor_parallel_size": 2}, "--tensor-parallel-size 2"),
        ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size 2"),
    ],
)
def test_more_than_one_rank_is_refused_before_loading(sizes, flag, tmp_path, checkpoint):
    args = EngineArgs(
        model=str(checkpoint),
        kv_transfer_config=transfer("kv_consumer", tmp_path),
        **sizes,
    )
    with pytest.raises(ConfigError, match=f"--kv-transfer-config is not supported with {flag}"):
        args.create_engine_config(make_plugin_manager())


def test_unknown_connector_and_unwritable_folder_are_refused_at_start(checkpoint, tmp_path):
    with pytest.raises(ConfigError, match=r"unknown kv_connector 'Nope'.*ExampleConnector"):
        build(
            checkpoint,
            kv_transfer_config={**transfer("kv_producer", tmp_path), "kv_connector": "Nope"},
        )
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="shared_storage_path .* is not a writable folder"):
        build(checkpoint, kv_transfer_config=transfer("kv_producer", blocker / "kv"))
    with pytest.raises(ConfigError, match="this engine serves the embed task"):
        build(checkpoint, kv_transfer_config=transfer("kv_consumer", tmp_path), task="embed")
    settings = transfer("kv_consumer", tmp_path)
    settings["kv_connector_extra_config"]["path"] = "x"
    with pytest.raises(ConfigError, match=r"keys \['path'\] are not ExampleConnector's"):
        build(checkpoint, kv_transfer_config=settings)


# ------------------------------------------- the scheduler's hook (no model, no connector)


class Loader(StepExtension):
    """Loads up to ``blocks`` whole blocks after the local hits of every request."""

    name = "loader"

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = blocks
        self.asked: list[tuple[str, int]] = []

    @classmethod
    def from_engine(cls, engine):
        return None

    def new(self, request: Request) -> Request:
        request.features[self.name] = True
        return request

    def external_tokens(self, request, num_cached):
        self.asked.append((request.request_id, num_cached))
        room = (request.num_tokens - 1 - num_cached) // BS
        return min(self.blocks, room) * BS


def test_loaded_tokens_are_allocated_and_computed_but_not_scheduled():
    loader = Loader(blocks=3)
    sched = make_scheduler(caching=True, max_num_batched_tokens=8, extensions=[loader])
    request = loader.new(add(sched, "a", 21))
    first = step(sched)
    # 3 blocks loaded (12 tokens), then 8 of the 9 others within the budget.
    assert first.new == {"a": 8}
    item = first.out.scheduled[0]
    assert item.num_computed_tokens == 12 and len(item.block_ids) == 5
    assert request.num_cached_tokens == 12 and loader.asked == [("a", 0)]
    step(sched)
    assert request.num_computed_tokens == 21 and request.output_token_ids == [TOK]
    # The loaded blocks are local prefix hits now: a second request is asked only after them.
    twin = loader.new(add(sched, "b", list(request.prompt_token_ids)))
    assert step(sched).new == {"a": 1, "b": 1}
    assert loader.asked[-1] == ("b", 20) and twin.num_computed_tokens == 21


def test_a_request_that_cannot_get_its_blocks_waits_and_is_asked_again():
    loader = Loader(blocks=4)
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=32, extensions=[loader])
    big = loader.new(add(sched, "a", 18, max_tokens=1))  # 5 blocks: the whole cache
    small = loader.new(add(sched, "b", 10))
    assert step(sched).new == {"a": 2}
    assert small.status is RequestStatus.WAITING and loader.asked == [("a", 0), ("b", 0)]
    assert big.is_finished
    assert step(sched).new == {"b": 2}
    assert loader.asked[-1] == ("b", 0) and small.num_computed_tokens == 10


# ------------------------------------------------------------------ offline engines


def test_consumer_loads_the_producers_blocks(pair, reference, checkpoint):
    producer, consumer, store = pair
    tokens = prompt(1, 45)  # 2 full blocks loadable, 13 tokens to compute
    assert greedy(producer, tokens, max_tokens=1) == reference_greedy(reference, tokens, 1)[0]
    keys = keys_of(tokens, producer)
    assert checkpoint_keys(checkpoint, tokens) == keys
    assert {p.name for p in store.iterdir()} >= {f"{k}.kv" for k in keys}
    before = counters(consumer)
    assert greedy(consumer, tokens) == reference_greedy(reference, tokens, NEW_TOKENS)[0]
    after = counters(consumer)
    # Only the 13 tokens after the loaded blocks were computed as prompt.
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (13, 45, 32)


def test_the_loaded_blocks_are_what_the_consumer_attends_to(pair, reference):
    """Blocks of the right size but other content change the consumer's output: it reads
    the KV from the files (and does not compute the prompt)."""
    producer, consumer, store = pair
    tokens = prompt(2, 40)
    greedy(producer, tokens, max_tokens=1)
    generator = torch.Generator().manual_seed(0)
    for key in keys_of(tokens, producer):
        path = store / f"{key}.kv"
        noise = torch.randn(path.stat().st_size // 4, generator=generator) * 30
        path.write_bytes(noise.numpy().tobytes())
    before = counters(consumer)
    assert greedy(consumer, tokens) != reference_greedy(reference, tokens, NEW_TOKENS)[0]
    assert counters(consumer)[2] - before[2] == 32


def test_missing_and_truncated_blocks_are_computed(pair, reference, caplog):
    producer, consumer, store = pair
    missing, truncated = prompt(3, 60), prompt(4, 60)
    for tokens in (missing, truncated):
        greedy(producer, tokens, max_tokens=1)
    (store / f"{keys_of(missing, producer)[1]}.kv").unlink()
    first = store / f"{keys_of(truncated, producer)[0]}.kv"
    first.write_bytes(first.read_bytes()[:100])
    caplog.set_level(logging.WARNING, logger="pagedllm.kv_transfer")

    before = counters(consumer)
    assert greedy(consumer, missing) == reference_greedy(reference, missing, NEW_TOKENS)[0]
    after = counters(consumer)
    # Block 0 loaded; blocks 1 and 2 (no file for 1) computed with the rest.
    assert (after[0] - before[0], after[2] - before[2]) == (60 - 16, 16)
    assert "1 of its 3 prompt blocks" in caplog.text

    assert greedy(consumer, truncated) == reference_greedy(reference, truncated, NEW_TOKENS)[0]
    assert (counters(consumer)[0] - after[0], counters(consumer)[2] - after[2]) == (60, 0)
    assert "truncated" in caplog.text


# ------------------------------------------------- two servers behind the example proxy


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    """A prefill server (kv_producer) and a decode server (kv_consumer) sharing a folder,
    behind ``examples/disagg_proxy.py``."""
    store = tmp_path_factory.mktemp("served_kv")
    logs = tmp_path_factory.mktemp("logs")

    def server(role: str) -> RemoteServer:
        config = json.dumps(transfer(role, store))
        return RemoteServer(
            checkpoint,
            *("--block-size", str(BLOCK), "--kv-transfer-config", config),
            log_path=logs / f"{role}.log",
        )

    prefill, decode = server("kv_producer"), server("kv_consumer")
    start_servers(prefill, decode)
    port = free_port()
    proxy_log = (logs / "proxy.log").open("wb")
    proxy = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "examples" / "disagg_proxy.py"),
            *("--prefill", prefill.url, "--decode", decode.url, "--port", str(port)),
        ],
        stdout=proxy_log,
        stderr=subprocess.STDOUT,
        env=clean_env(),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proxy.poll() is None and time.monotonic() < deadline, (
                logs / "proxy.log"
            ).read_text()
            time.sleep(0.2)
        yield prefill, decode, url, store
    finally:
        proxy.terminate()
        proxy.wait(20)
        proxy_log.close()
        prefill.stop()
        decode.stop()


def completion(url: str, model: Path, tokens: list[int], **extra) -> dict:
    body = {
        "model": str(model),
        "prompt": tokens,
        "max_tokens": NEW_TOKENS,
        "min_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        **extra,
    }
    response = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def token_ids(answer: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]


def served_counters(decode: RemoteServer) -> tuple[float, ...]:
    """The decode server's prompt tokens, connector queries and hits (0 before any step)."""
    samples = decode.metrics()
    names = ("prompt_tokens", "external_prefix_cache_queries", "external_prefix_cache_hits")
    return tuple(
        sum(v for k, v in samples.items() if k.startswith(f"pagedllm:{name}_total{{"))
        for name in names
    )


def test_proxy_gives_one_instances_tokens_and_decode_loads_the_prompt(
    served, checkpoint, reference
):
    prefill, decode, url, _ = served
    tokens = prompt(11, 45)
    expected = reference_greedy(reference, tokens, NEW_TOKENS)[0]
    before = served_counters(decode)
    assert token_ids(completion(url, checkpoint, tokens)) == expected
    after = served_counters(decode)
    # The decode instance computed only the 13 prompt tokens after the 2 loaded blocks.
    assert tuple(a - b for a, b in zip(after, before, strict=True)) == (13, 45, 32)

    # Streamed through the proxy: the same text as one plain instance computes.
    tokens = prompt(12, 50)
    plain = completion(prefill.url, checkpoint, tokens)["choices"][0]["text"]
    body = {"model": str(checkpoint), "prompt": tokens, "max_tokens": NEW_TOKENS}
    body.update(min_tokens=NEW_TOKENS, temperature=0.0, stream=True)
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == plain
    assert served_counters(decode)[2] - after[2] == 48


def test_proxy_streams_chat_as_one_instance_answers(served, checkpoint):
    prefill, decode, url, _ = served
    messages = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 4}]
    params = dict(model=str(checkpoint), messages=messages, max_tokens=NEW_TOKENS)
    params.update(temperature=0.0, extra_body={"min_tokens": NEW_TOKENS})
    plain = prefill.client().chat.completions.create(**params).choices[0].message.content
    hits = served_counters(decode)[2]
    proxied = RemoteServer.client(decode, base_url=url + "/v1")
    chunks = proxied.chat.completions.create(stream=True, **params)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    assert served_counters(decode)[2] > hits


def test_decode_computes_a_truncated_block_and_keeps_serving(served, checkpoint, reference):
    prefill, decode, url, store = served
    tokens = prompt(13, 45)
    completion(prefill.url, checkpoint, tokens, max_tokens=1, min_tokens=0)
    for key in checkpoint_keys(checkpoint, tokens):
        path = store / f"{key}.kv"
        path.write_bytes(path.read_bytes()[:64])
    before = served_counters(decode)
    answer = completion(decode.url, checkpoint, tokens)
    assert token_ids(answer) == reference_greedy(reference, tokens, NEW_TOKENS)[0]
    assert served_counters(decode)[0] - before[0] == 45
    assert served_counters(decode)[2] == before[2]
    assert "truncated" in decode.log_text()
    # ... and the next prompt goes through the proxy as before.
    tokens = prompt(14, 40)
    assert (
        token_ids(completion(url, checkpoint, tokens))
        == reference_greedy(reference, tokens, NEW_TOKENS)[0]
    )


# --------------------------------------------------- the TCP connector, process to process


def tcp(role: str, **extra) -> dict:
    return {"kv_connector": "TCPConnector", "kv_role": role, "kv_connector_extra_config": extra}


def test_tcp_consumer_pulls_from_a_producer_process_and_outlives_it(
    checkpoint, reference, tmp_path
):
    port = free_port()
    producer = RemoteServer(
        checkpoint,
        *("--block-size", str(BLOCK)),
        *("--kv-transfer-config", json.dumps(tcp("kv_producer", listen_port=port))),
        log_path=tmp_path / "producer.log",
    )
    start_servers(producer)
    try:
        consumer = build(
            checkpoint,
            kv_transfer_config=tcp("kv_consumer", peer=f"127.0.0.1:{port}", timeout_s=5),
        )
        tokens = prompt(21, 45)
        completion(producer.url, checkpoint, tokens, max_tokens=1, min_tokens=0)
        before = counters(consumer)
        assert greedy(consumer, tokens) == reference_greedy(reference, tokens, NEW_TOKENS)[0]
        after = counters(consumer)
        assert (after[0] - before[0], after[2] - before[2]) == (13, 32)
    finally:
        producer.stop(signal.SIGKILL)
    # The producer is gone: its prompts are computed here.
    tokens = prompt(22, 45)
    started = time.monotonic()
    assert greedy(consumer, tokens) == reference_greedy(reference, tokens, NEW_TOKENS)[0]
    assert time.monotonic() - started < 30
    assert (counters(consumer)[0] - after[0], counters(consumer)[2] - after[2]) == (45, 0)


class HostilePeer:
    """A producer that holds every block it is asked about, then sends ``sent`` bytes of
    the first and closes the connection (``stall``: stops sending and keeps it open)."""

    def __init__(self, sent: int, stall: bool) -> None:
        self.sent, self.stall = sent, stall
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            op = conn.recv(1)
            count = int.from_bytes(conn.recv(4), "big")
            while count and len(conn.recv(32 * count, socket.MSG_WAITALL)) < 32 * count:
                pass
            if op == b"L":
                conn.sendall(count.to_bytes(4, "big"))
                conn.close()
            else:
                conn.sendall(b"\1" + bytes(self.sent))
                if self.stall:
                    self.held.append(conn)
                else:
                    conn.close()

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.mark.parametrize("stall", [False, True], ids=["dies", "stalls"])
def test_tcp_peer_failing_mid_transfer_means_computing_the_prompt(
    checkpoint, reference, stall, caplog
):
    peer = HostilePeer(sent=1000, stall=stall)
    try:
        consumer = build(
            checkpoint,
            kv_transfer_config=tcp("kv_consumer", peer=f"127.0.0.1:{peer.port}", timeout_s=1),
        )
        caplog.set_level(logging.WARNING, logger="pagedllm.kv_transfer")
        tokens = prompt(23, 45)
        started = time.monotonic()
        assert greedy(consumer, tokens) == reference_greedy(reference, tokens, NEW_TOKENS)[0]
        assert time.monotonic() - started < 20
        assert counters(consumer)[::2] == (45, 0)
        assert "0 of 2 blocks from 127.0.0.1" in caplog.text
    finally:
        peer.close()


def test_tcp_settings_are_checked_at_start(checkpoint):
    with pytest.raises(ConfigError, match="peer None: give the producer's address"):
        build(checkpoint, kv_transfer_config=tcp("kv_consumer"))
    with pytest.raises(ConfigError, match="listen_port None"):
        build(checkpoint, kv_transfer_config=tcp("kv_producer"))
    # A producer's port is free again once its engine stops.
    port = free_port()
    settings = tcp("kv_producer", listen_port=port)
    build(checkpoint, kv_transfer_config=settings).llm_engine.shutdown()
    build(checkpoint, kv_transfer_config=settings).llm_engine.shutdown()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            build(checkpoint, kv_transfer_config=tcp("kv_producer", listen_port=port))


def test_serve_with_an_unusable_folder_exits_naming_it(checkpoint, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    config = json.dumps(transfer("kv_producer", blocker / "kv"))
    result = run_cli(
        "serve",
        str(checkpoint),
        "--dtype",
        "float32",
        "--kv-transfer-config",
        config,
        timeout=300,
    )
    assert result.returncode != 0
    assert f"shared_storage_path '{blocker / 'kv'}' is not a writable folder" in result.stderr
