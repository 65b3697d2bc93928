"""vLLM's ZeroMQ KV-event publisher, on the wire exactly as vLLM sends it, so a router
written for vLLM (decoding with vLLM's own msgspec structs) subscribes unchanged.

- Each batch of one step's events is a ``KVEventBatch`` (msgpack, array-like:
  ``[ts, events, data_parallel_rank]``), each event a map tagged ``"type"``
  (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) with vLLM's fields, in vLLM's
  order, defaults left out.
- The PUB socket sends ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian counter,
  one more per batch.
- A late subscriber asks the ROUTER ``replay_endpoint`` for the batches from a sequence
  number on (a message ``[b"", seq]`` from a DEALER or REQ): it gets each kept batch as
  ``[b"", topic, seq, payload]``, then ``[b"", b"", seq=-1, b""]``.
- With data parallelism, replica ``r`` adds ``r`` to the endpoints' ports (an ``inproc``
  endpoint gets ``_dp<r>``), and its batches carry ``data_parallel_rank=r``.

A slow subscriber never slows the engine: :meth:`ZmqEventPublisher.publish` only puts the
batch in a bounded queue (a full queue drops it, with a warning), a thread encodes and
sends, and the PUB socket drops what a subscriber has not taken past ``hwm``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from pagedllm.core.errors import ConfigError
from pagedllm.core.kv_cache import events as core_events

logger = logging.getLogger("pagedllm.kv_events")

ExternalBlockHash = int | bytes


# The wire format: vLLM's structs (vllm/distributed/kv_events.py), field for field.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
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
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# pagedllm has one KV-cache group (every layer shares the block tables): vLLM's group 0.
_GROUP = 0
# Where the blocks live, in vLLM's words: "GPU" is the engine's own KV cache (on any device;
# "CPU" and "STORAGE" are vLLM's offloading tiers).
_MEDIUM = "GPU"


def to_wire(event: core_events.KVCacheEvent) -> KVCacheEvent:
    """The core's event as vLLM's struct."""
    if isinstance(event, core_events.BlockStored):
        return BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            # (an adapter's blocks have hashes of their own: its id is in them)
            lora_id=None,
            medium=_MEDIUM,
            lora_name=None,
            group_idx=_GROUP,
        )
    if isinstance(event, core_events.BlockRemoved):
        return BlockRemoved(block_hashes=event.block_hashes, medium=_MEDIUM, group_idx=_GROUP)
    if isinstance(event, core_events.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"not a KV-cache event: {event!r}")


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """``endpoint`` for data-parallel replica ``data_parallel_rank`` (vLLM's rule): a tcp
    port plus the rank (port 0 stays 0: the OS picks), an inproc name plus ``_dp<rank>``."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        if not base or not port.isdigit() or int(port) == 0:
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ConfigError(
        f"--kv-events-config endpoint {endpoint!r}: with data parallelism an endpoint must "
        "be tcp:// or inproc:// (each replica takes its own)"
    )


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or an ipc/inproc endpoint is bound, any other connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB socket (and ROUTER replay socket) fed by a thread from a bounded queue."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)
    SHUTDOWN_TIMEOUT = 2.0

    def __init__(self, config: Any, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[tuple[float, list[Any]] | None] = queue.Queue(
            maxsize=config.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self.dropped = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(config.hwm)
            self.endpoint = self._open(
                self._pub, offset_endpoint_port(config.endpoint, data_parallel_rank), "endpoint"
            )
            self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, data_parallel_rank)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.set_hwm(config.hwm)
                self.replay_endpoint = self._open(
                    self._replay, self.replay_endpoint, "replay_endpoint", bind=True
                )
        except BaseException:
            self._close_sockets()
            raise
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedllm-kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "KV-cache events: publishing on %s%s",
            self.endpoint,
            f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "",
        )

    @staticmethod
    def _open(sock: zmq.Socket, endpoint: Any, key: str, bind: bool = False) -> str:
        """Bind (or connect) ``sock``; the endpoint as bound (a port 0 resolved)."""
        try:
            if bind or _binds(endpoint):
                sock.bind(endpoint)
                return sock.getsockopt_string(zmq.LAST_ENDPOINT)
            sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as exc:
            raise ConfigError(f"--kv-events-config {key} {endpoint!r}: {exc}") from None

    def publish(self, events: list[Any]) -> None:
        """Queue one step's events (never blocks: a full queue drops them, warned)."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning(
                    "KV-cache events: the publisher's queue is full (max_queue_size %d); "
                    "%d batches dropped so far",
                    self._queue.maxsize,
                    self.dropped,
                )

    def shutdown(self) -> None:
        """Send what is queued (for at most SHUTDOWN_TIMEOUT seconds), then close."""
        self._closing.set()
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():
            logger.warning("KV-cache events: %d batches not sent at shutdown", self._queue.qsize())
        else:
            self._close_sockets()
            self._ctx.term()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    # ---------------------------------------------------------- the publisher's thread

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seqs = itertools.count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    logger.exception("KV-cache events: a replay request failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            if item is None:
                return
            ts, events = item
            try:
                batch = KVEventBatch(
                    ts=ts,
                    events=[to_wire(e) for e in events],
                    data_parallel_rank=self.data_parallel_rank,
                )
                payload = encoder.encode(batch)
                seq = next(seqs)
                # (PUB never blocks: past a subscriber's hwm its messages are dropped.)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:
                logger.exception("KV-cache events: a batch could not be published")

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV-cache events: invalid replay request (%d frames)", len(frames))
            return
        client, empty, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart(
                    (client, empty, self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK
                )
        self._replay.send_multipart((client, empty, b"", self.END_SEQ, b""), zmq.NOBLOCK)
