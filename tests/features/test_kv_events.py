"""--kv-events-config: the KV cache's events, published over ZeroMQ in vLLM's wire format.

A subscriber in another process (pyzmq) receives what an engine publishes; the test
decodes it with msgspec structs declared the way vLLM declares them
(``vllm/distributed/kv_events.py``), and checks that encoding the decoded batch with
them gives back the very bytes received (so vLLM's own decoder reads ours).
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import logging
import queue
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec
import pytest
from core.test_kv_cache import BS, make_request, prefill
from openai_server import RemoteServer, start_servers, tiny_llama
from tiny_models import make_checkpoint

from pagedllm import LLM, SamplingParams
from pagedllm.core.config import KVEventsConfig
from pagedllm.core.engine_args import EngineArgs
from pagedllm.core.errors import ConfigError
from pagedllm.core.kv_cache import KVCacheManager, get_hash_fn, hash_request_tokens
from pagedllm.core.kv_cache import events as core_events
from pagedllm.core.plugins import make_plugin_manager
from pagedllm.features.kv_event_publisher import ZmqEventPublisher, offset_endpoint_port
from pagedllm.features.kv_events import publisher_class

BLOCK = 8
TIMEOUT = 120.0


# ------------------------------------------------ vLLM's structs (the decoder's side)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
ENCODER = msgspec.msgpack.Encoder()


# ------------------------------------------------------------ the subscriber process

SUBSCRIBER = r"""
import base64, json, sys, zmq

mode, endpoint, topic = sys.argv[1], sys.argv[2], sys.argv[3].encode()
ctx = zmq.Context()

def show(topic, seq, payload):
    seq = int.from_bytes(seq, "big", signed=True)
    text = base64.b64encode(payload).decode()
    print(json.dumps({"topic": topic.decode(), "seq": seq, "payload": text}), flush=True)
    return seq

if mode == "replay":
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", int(sys.argv[4]).to_bytes(8, "big")])
    while sock.poll(120_000):
        if show(*sock.recv_multipart()[1:]) == -1:
            break
    sys.exit(0)

sock = ctx.socket(zmq.SUB)
if mode == "stall":
    sock.setsockopt(zmq.RCVHWM, 1)
sock.setsockopt(zmq.SUBSCRIBE, topic)
sock.connect(endpoint)
poller = zmq.Poller()
poller.register(sys.stdin.fileno(), zmq.POLLIN)
if mode == "sub":
    poller.register(sock, zmq.POLLIN)
print("ready", flush=True)
while True:
    ready = dict(poller.poll())
    if sys.stdin.fileno() in ready:  # (stdin closed: stop; a stalled one never read)
        break
    if sock in ready:
        show(*sock.recv_multipart())
"""


class Subscriber:
    """A subscriber process; its output lines, one per message received, in a queue."""

    def __init__(self, mode: str, endpoint: str, topic: str = "kv", *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SUBSCRIBER, mode, endpoint, topic, *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        if mode != "replay":
            assert self.lines.get(timeout=TIMEOUT) == "ready"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def message(self, timeout: float = TIMEOUT) -> dict[str, Any]:
        """The next message: its topic, seq, payload (bytes) and batch (decoded)."""
        message = json.loads(self.lines.get(timeout=timeout))
        message["payload"] = base64.b64decode(message["payload"])
        if message["seq"] != -1:
            message["batch"] = DECODER.decode(message["payload"])
        return message

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def served(checkpoint):
    """An engine publishing on a free port (replay on another), 8 blocks of 8 tokens: a
    few requests evict each other's blocks."""
    port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv",
        "hwm": 16,
    }
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        disable_log_stats=True,
        block_size=BLOCK,
        num_gpu_blocks_override=8,
        enable_prefix_caching=True,
        kv_events_config=config,
    )
    yield llm, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
    llm.shutdown()


def handshake(llm: LLM, subscriber: Subscriber) -> dict[str, Any]:
    """Publish AllBlocksCleared batches until the subscriber gets one (a SUB socket
    receives only once its subscription reached the publisher); the first received."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        assert llm.reset_prefix_cache()
        try:
            first = subscriber.message(timeout=0.5)
        except queue.Empty:
            continue
        time.sleep(0.5)
        while True:  # (the later probes' batches)
            try:
                first = subscriber.message(timeout=0.5)
            except queue.Empty:
                return first
    raise AssertionError("the subscriber received nothing")


def generate(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    (output,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return list(output.outputs[0].token_ids)


def events_of(messages: list[dict[str, Any]], kind: type) -> list[Any]:
    return [e for m in messages for e in m["batch"].events if isinstance(e, kind)]


def test_a_subscriber_process_receives_vllm_events(served):
    llm, endpoint, replay_endpoint = served
    subscriber = Subscriber("sub", endpoint)
    try:
        first = handshake(llm, subscriber)
        # 30 prompt tokens and 4 generated: 3 blocks full at the prefill, the 4th while
        # decoding (its own event, chained on the 3rd block).
        prompt = [5 + (i * 7) % 50 for i in range(30)]
        tokens = prompt + generate(llm, prompt, 4)
        # Two more requests of 5 blocks each, in 8 blocks: they evict the first's.
        for offset in (100, 200):
            generate(llm, [offset + i for i in range(30)], 4)
        assert llm.reset_prefix_cache()
        messages = []
        while not messages or not isinstance(messages[-1]["batch"].events[-1], AllBlocksCleared):
            messages.append(subscriber.message())
    finally:
        subscriber.close()

    # One batch per step with events, numbered one more each, on the topic, from rank 0.
    assert [m["seq"] for m in messages] == list(
        range(first["seq"] + 1, first["seq"] + 1 + len(messages))
    )
    assert {m["topic"] for m in messages} == {"kv"}
    assert {m["batch"].data_parallel_rank for m in messages} == {0}
    # vLLM's encoder, given what its decoder read, writes the very bytes we sent.
    for message in messages:
        assert ENCODER.encode(message["batch"]) == message["payload"]

    stored = events_of(messages, BlockStored)
    first_request = stored[:2]
    expected = hash_request_tokens(get_hash_fn("builtin"), BLOCK, tokens)
    assert [h for e in first_request for h in e.block_hashes] == [
        h.hash_value for h in expected[:4]
    ]
    assert [t for e in first_request for t in e.token_ids] == tokens[: 4 * BLOCK]
    assert first_request[0].parent_block_hash is None
    assert len(first_request[0].block_hashes) == 3
    assert first_request[1].parent_block_hash == first_request[0].block_hashes[-1]
    for event in stored:
        assert (event.block_size, event.medium, event.lora_id, event.group_idx) == (
            BLOCK,
            "GPU",
            None,
            0,
        )
        assert len(event.token_ids) == BLOCK * len(event.block_hashes)
    # Every other request's chain starts at its first block too.
    assert [e.parent_block_hash for e in stored[2:]].count(None) == 2

    removed = {h for e in events_of(messages, BlockRemoved) for h in e.block_hashes}
    stored_hashes = {h for e in stored for h in e.block_hashes}
    assert removed and removed <= stored_hashes
    assert set(first_request[0].block_hashes) <= removed  # (evicted by the later requests)
    assert isinstance(messages[-1]["batch"].events[-1], AllBlocksCleared)

    # A late subscriber replays from a sequence number: the same batches, then -1.
    replay = Subscriber("replay", replay_endpoint, "kv", str(first["seq"] + 1))
    try:
        replayed = []
        while not replayed or replayed[-1]["seq"] != -1:
            replayed.append(replay.message())
    finally:
        replay.close()
    assert [(m["seq"], m["payload"]) for m in replayed[:-1]] == [
        (m["seq"], m["payload"]) for m in messages
    ]


def test_a_subscriber_that_never_reads_does_not_stall_the_engine(served):
    llm, endpoint, _ = served
    stalled = Subscriber("stall", endpoint)
    try:
        time.sleep(1.0)  # (its subscription reaches the publisher)
        started = time.monotonic()
        for offset in range(0, 400, 20):  # (far more batches than the PUB's hwm of 16)
            generate(llm, [offset + i for i in range(30)], 4)
        assert time.monotonic() - started < TIMEOUT
        # The publisher still publishes: a new subscriber gets the next batches.
        live = Subscriber("sub", endpoint)
        try:
            handshake(llm, live)
            generate(llm, [7 + i for i in range(30)], 2)
            assert isinstance(live.message()["batch"], KVEventBatch)
        finally:
            live.close()
    finally:
        stalled.close()


def test_reset_prefix_cache_refuses_what_it_cannot_do(served):
    llm = served[0]
    with pytest.raises(ValueError, match="reset_running_requests=True.* not supported"):
        llm.reset_prefix_cache(reset_running_requests=True)
    with pytest.raises(ValueError, match="no KV connector"):
        llm.reset_prefix_cache(reset_connector=True)


def _two_free_ports() -> int:
    """A port that is free, and so is the next one."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


def test_each_data_parallel_replica_publishes_on_its_port_with_its_rank(tmp_path_factory):
    """``serve -dp 2``: replica r publishes on the endpoint's port + r, as rank r."""
    model = tiny_llama(tmp_path_factory)
    port = _two_free_ports()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "topic": "kv"}
    server = RemoteServer(
        model,
        "-dp",
        "2",
        "--kv-events-config",
        json.dumps(config),
        log_path=tmp_path_factory.mktemp("kv_events") / "server.log",
    )
    start_servers(server)
    subscribers = [Subscriber("sub", f"tcp://127.0.0.1:{port + rank}") for rank in (0, 1)]
    try:
        client = server.client()
        received: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + TIMEOUT
        batch = 0
        while len(received) < 2 and time.monotonic() < deadline:
            # (concurrent requests, so both replicas get some; new prompts: new blocks)
            prompts = [[(batch * 97 + i * 13 + j) % 500 + 6 for j in range(40)] for i in range(4)]
            batch += 1
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                list(
                    pool.map(
                        lambda p: client.completions.create(
                            model=str(model), prompt=p, max_tokens=2
                        ),
                        prompts,
                    )
                )
            for rank, subscriber in enumerate(subscribers):
                try:
                    received.setdefault(rank, subscriber.message(timeout=1.0))
                except queue.Empty:
                    pass
        assert sorted(received) == [0, 1], server.log_text()
        for rank, message in received.items():
            assert message["batch"].data_parallel_rank == rank
            assert message["topic"] == "kv"
            assert any(isinstance(e, BlockStored) for e in message["batch"].events)
    finally:
        for subscriber in subscribers:
            subscriber.close()
        server.stop()


# -------------------------------------------------------------------- publisher


def test_a_full_queue_drops_batches_with_a_warning(caplog):
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", max_queue_size=1)
    publisher = ZmqEventPublisher(config)
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm.kv_events"):
            started = time.monotonic()
            for _ in range(20_000):
                publisher.publish([core_events.AllBlocksCleared()])
            assert time.monotonic() - started < 10
    finally:
        publisher.shutdown()
    assert publisher.dropped > 0
    assert "the publisher's queue is full (max_queue_size 1)" in caplog.text


def test_a_data_parallel_replica_offsets_its_port_and_names_its_rank():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://*:0", 3) == "tcp://*:0"
    assert offset_endpoint_port("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint_port(None, 2) is None
    port = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port - 2}", topic="kv")
    publisher = ZmqEventPublisher(config, data_parallel_rank=2)
    subscriber = Subscriber("sub", f"tcp://127.0.0.1:{port}")
    try:
        assert publisher.endpoint.endswith(f":{port}")
        deadline = time.monotonic() + TIMEOUT
        message = None
        while message is None and time.monotonic() < deadline:
            publisher.publish([core_events.AllBlocksCleared()])
            try:
                message = subscriber.message(timeout=0.5)
            except queue.Empty:
                pass
        assert message is not None
        assert message["batch"].data_parallel_rank == 2
    finally:
        subscriber.close()
        publisher.shutdown()


def test_a_taken_endpoint_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
        with pytest.raises(ConfigError, match=f"--kv-events-config endpoint 'tcp://\\*:{port}'"):
            ZmqEventPublisher(config)


# ------------------------------------------------------------------ configuration


def test_the_config_takes_vllms_keys_and_defaults():
    config = KVEventsConfig.from_dict({"enable_kv_cache_events": True})
    assert (config.publisher, config.endpoint, config.replay_endpoint, config.topic) == (
        "zmq",
        "tcp://*:5557",
        None,
        "",
    )
    assert (config.buffer_steps, config.hwm, config.max_queue_size) == (10_000, 100_000, 100_000)
    assert KVEventsConfig.from_dict({}).publisher == "null"
    pm = make_plugin_manager()
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['endpont'\]"):
        EngineArgs(model="m", kv_events_config={"endpont": "tcp://*:1"}).create_engine_config(pm)
    with pytest.raises(ConfigError, match="--kv-events-config hwm=-1 is invalid"):
        KVEventsConfig(hwm=-1)
    with pytest.raises(ConfigError, match=r"publisher='kafka' is not a publisher; choose one"):
        publisher_class("kafka")
    assert publisher_class("null") is None
    assert publisher_class("zmq") is ZmqEventPublisher


def test_an_unknown_publisher_is_refused_before_the_model_loads(tmp_path):
    config = {"enable_kv_cache_events": True, "publisher": "kafka"}
    with pytest.raises(ConfigError, match="publisher='kafka' is not a publisher"):
        EngineArgs(model=str(tmp_path), kv_events_config=config).create_engine_config(
            make_plugin_manager()
        )


class ListPublisher:
    """A publisher of a plugin's (``"publisher": "module:Class"``): keeps what it gets."""

    made: list[ListPublisher] = []

    def __init__(self, config: Any, data_parallel_rank: int) -> None:
        self.batches: list[list[Any]] = []
        self.closed = False
        ListPublisher.made.append(self)

    def publish(self, events: list[Any]) -> None:
        self.batches.append(events)

    def shutdown(self) -> None:
        self.closed = True


def test_a_plugins_publisher_gets_each_steps_events(checkpoint):
    config = {"enable_kv_cache_events": True, "publisher": f"{__name__}:ListPublisher"}
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        disable_log_stats=True,
        block_size=BLOCK,
        num_gpu_blocks_override=16,
        kv_events_config=config,
    )
    prompt = list(range(10, 30))
    generate(llm, prompt, 2)
    llm.shutdown()
    (publisher,) = ListPublisher.made
    assert publisher.closed
    (batch,) = [b for b in publisher.batches if b]
    (event,) = batch
    assert isinstance(event, core_events.BlockStored)
    assert event.token_ids == prompt[: 2 * BLOCK]


def test_a_default_engine_does_not_import_zmq():
    code = (
        "import sys, pagedllm; from pagedllm import LLM, EngineArgs; "
        "import pagedllm.features.kv_events; "
        "print(sorted(m for m in ('zmq', 'msgspec') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --------------------------------------------------------- the core's event records


def manager_with_events(num_blocks: int = 8, hash_algo: str = "builtin") -> KVCacheManager:
    manager = KVCacheManager(num_blocks=num_blocks, block_size=BS, hash_algo=hash_algo)
    manager.record_events()
    return manager


def test_blocks_cached_in_chunks_chain_on_the_previous_chunk():
    manager = manager_with_events()
    request = make_request("r", list(range(10)))
    manager.allocate_slots(request, 5)  # (one full block)
    request.num_computed_tokens = 5
    manager.allocate_slots(request, 5)  # (the second)
    first, second = manager.take_events()
    assert first.parent_block_hash is None and first.token_ids == [0, 1, 2, 3]
    assert second.parent_block_hash == first.block_hashes[0]
    assert second.token_ids == [4, 5, 6, 7]
    assert manager.take_events() == []


def test_a_preempted_requests_unwritten_blocks_are_removed():
    manager = manager_with_events()
    request = make_request("r", list(range(12)))
    manager.allocate_slots(request, 12)  # (3 blocks hashed, none computed yet)
    (stored,) = manager.take_events()
    request.num_computed_tokens = 4
    manager.free(request)
    removed = manager.take_events()
    assert [e.block_hashes for e in removed] == [[stored.block_hashes[1]], [stored.block_hashes[2]]]


def test_a_second_copy_of_a_cached_block_is_not_announced_and_runs_split():
    manager = manager_with_events()
    a = make_request("a", list(range(8)))
    manager.allocate_slots(a, 8)
    b = make_request("b", [0, 1, 2, 3, 50, 51, 52, 53])  # (first block equal to a's)
    manager.allocate_slots(b, 8)  # (same step: no hit; block 0 is a's already)
    stored_a, stored_b = manager.take_events()
    assert len(stored_a.block_hashes) == 2
    assert stored_b.parent_block_hash == stored_a.block_hashes[0]
    assert stored_b.token_ids == [50, 51, 52, 53]


def test_a_beams_partial_tail_is_never_announced():
    manager = manager_with_events()
    request = make_request("r", list(range(6)), keep_kv_tail=True)
    prefill(manager, request)
    manager.free(request)
    assert manager._tails  # (its 2 last tokens are cached as a partial block)
    for i in range(8):  # (enough requests to evict everything)
        other = make_request(f"o{i}", [100 + i] * 16)
        prefill(manager, other)
        manager.free(other)
    assert not manager._tails
    events = manager.take_events()
    stored = {h for e in events if isinstance(e, core_events.BlockStored) for h in e.block_hashes}
    removed = [h for e in events if isinstance(e, core_events.BlockRemoved) for h in e.block_hashes]
    assert events[0].block_hashes[0] in removed
    assert set(removed) <= stored and len(removed) == len(set(removed))


def test_sha256_hashes_are_published_as_their_32_bytes():
    manager = manager_with_events(hash_algo="sha256")
    request = make_request("r", list(range(4)))
    manager.allocate_slots(request, 4)
    (event,) = manager.take_events()
    (expected,) = hash_request_tokens(get_hash_fn("sha256"), BS, list(range(4)))
    assert event.block_hashes == [expected.hash_value.to_bytes(32, "big")]
    assert manager.reset_prefix_cache() is False  # (a request holds blocks)
    request.num_computed_tokens = 4
    manager.free(request)
    assert manager.reset_prefix_cache()
    assert [type(e) for e in manager.take_events()] == [core_events.AllBlocksCleared]


def test_events_are_off_by_default():
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    prefill(manager, make_request("r", list(range(8))))
    assert manager.take_events() == []
    assert manager.block_pool.events is None


def test_the_log_is_bounded():
    log = core_events.KVEventLog(BS, max_events=3)
    for _ in range(5):
        log.cleared()
    assert len(log.take()) == 3 and log.dropped == 0
