"""The TCP KV connector (``TCPConnector``): a producer keeps its prompts' blocks in memory
and serves them on a TCP port; a consumer pulls them from it by key.

``kv_connector_extra_config``: the producer's ``listen_port`` (and ``listen_host``,
default 127.0.0.1; ``max_blocks`` it keeps, the least recently saved or read dropped
first, default 1024); the consumer's ``peer`` (``host:port``) and ``timeout_s`` (each
connection's and each read's limit, default 5). A peer that is gone, stalls or closes
mid-block costs at most that time: the blocks received whole are loaded, the rest of the
prompt is computed.

The protocol, one request per connection: ``op`` (``L``: lookup, ``G``: get), a 4-byte
count, then the 32-byte keys; a lookup is answered by the 4-byte count of leading keys
held, a get by each block in turn (a 1 byte, then the block's bytes; 0: not held, and the
answer ends).
"""

from __future__ import annotations

import collections
import logging
import socket
import socketserver
import struct
import threading
from collections.abc import Sequence
from typing import Any

import torch

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces.kv_connector import ConnectorSide, KVBlockLayout, KVConnector

logger = logging.getLogger("pagedllm.kv_transfer")

_EXTRA_KEYS = ("listen_host", "listen_port", "max_blocks", "peer", "timeout_s")
_COUNT = struct.Struct("!I")
_KEY_BYTES = 32


def _fail(message: str) -> ConfigError:
    return ConfigError(f"--kv-transfer-config: TCPConnector: {message}")


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError(
                f"the peer closed the connection after {len(data)} of {size} bytes"
            )
        data += chunk
    return bytes(data)


class _BlockStore:
    """The producer's blocks by key (bytes), the least recently used dropped first."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.blocks: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self.lock = threading.Lock()

    def put(self, key: bytes, data: bytes) -> None:
        with self.lock:
            self.blocks[key] = data
            self.blocks.move_to_end(key)
            while len(self.blocks) > self.max_blocks:
                self.blocks.popitem(last=False)

    def get(self, key: bytes) -> bytes | None:
        with self.lock:
            data = self.blocks.get(key)
            if data is not None:
                self.blocks.move_to_end(key)
            return data


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        assert isinstance(self.server, _Server)
        store = self.server.store
        sock: socket.socket = self.request
        sock.settimeout(30.0)
        try:
            op = _recv_exactly(sock, 1)
            (count,) = _COUNT.unpack(_recv_exactly(sock, _COUNT.size))
            keys = [_recv_exactly(sock, _KEY_BYTES) for _ in range(count)]
            if op == b"L":
                held = 0
                for key in keys:
                    if store.get(key) is None:
                        break
                    held += 1
                sock.sendall(_COUNT.pack(held))
            elif op == b"G":
                for key in keys:
                    data = store.get(key)
                    if data is None:
                        sock.sendall(b"\0")
                        break
                    sock.sendall(b"\1" + data)
        except OSError as exc:  # (a consumer that went away)
            logger.debug("KV transfer: a transfer to %s ended: %s", self.client_address, exc)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], store: _BlockStore) -> None:
        super().__init__(address, _Handler)
        self.store = store


class TCPConnector(KVConnector):
    name = "TCPConnector"

    def __init__(self, config: Any, layout: KVBlockLayout, side: ConnectorSide) -> None:
        super().__init__(config, layout, side)
        extra = config.kv_connector_extra_config
        unknown = sorted(set(extra) - set(_EXTRA_KEYS))
        if unknown:
            raise _fail(
                f"kv_connector_extra_config keys {unknown} are not TCPConnector's "
                f"(known: {list(_EXTRA_KEYS)})"
            )
        self.server: _Server | None = None
        if side == "worker":
            self._serve(extra)
        else:
            peer = extra.get("peer")
            host, _, port = str(peer or "").rpartition(":")
            if not host or not port.isdigit():
                raise _fail(f"peer {peer!r}: give the producer's address as 'host:port'")
            self.peer = (host, int(port))
            self.timeout_s = float(extra.get("timeout_s", 5.0))
            if self.timeout_s <= 0:
                raise _fail(f"timeout_s must be > 0, got {self.timeout_s}")

    def _serve(self, extra: dict[str, Any]) -> None:
        port = extra.get("listen_port")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise _fail(f"listen_port {port!r}: the producer needs a TCP port to serve blocks on")
        max_blocks = extra.get("max_blocks", 1024)
        if not isinstance(max_blocks, int) or max_blocks < 1:
            raise _fail(f"max_blocks must be a positive integer, got {max_blocks!r}")
        host = extra.get("listen_host", "127.0.0.1")
        try:
            self.server = _Server((host, port), _BlockStore(max_blocks))
        except OSError as exc:
            raise _fail(f"cannot listen on {host}:{port}: {exc}") from None
        threading.Thread(
            target=self.server.serve_forever, name="kv-transfer-tcp", daemon=True
        ).start()
        logger.info("KV transfer: serving blocks on %s:%d", host, port)

    def _ask(self, op: bytes, keys: Sequence[str]) -> socket.socket:
        sock = socket.create_connection(self.peer, timeout=self.timeout_s)
        try:
            payload = b"".join(bytes.fromhex(k) for k in keys)
            sock.sendall(op + _COUNT.pack(len(keys)) + payload)
        except BaseException:
            sock.close()
            raise
        return sock

    def lookup(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        try:
            with self._ask(b"L", keys) as sock:
                (held,) = _COUNT.unpack(_recv_exactly(sock, _COUNT.size))
        except OSError as exc:
            logger.warning("KV transfer: no lookup from %s:%d: %s", *self.peer, exc)
            return 0
        return min(held, len(keys))

    def load(self, keys: Sequence[str]) -> list[torch.Tensor]:
        blocks: list[torch.Tensor] = []
        if not keys:
            return blocks
        layout = self.layout
        try:
            with self._ask(b"G", keys) as sock:
                for _ in keys:
                    if _recv_exactly(sock, 1) != b"\1":
                        logger.warning("KV transfer: %s:%d no longer holds a block", *self.peer)
                        break
                    raw = bytearray(_recv_exactly(sock, layout.nbytes))
                    blocks.append(
                        torch.frombuffer(raw, dtype=torch.uint8)
                        .view(layout.dtype)
                        .view(layout.shape)
                    )
        except OSError as exc:
            logger.warning(
                "KV transfer: %d of %d blocks from %s:%d: %s",
                len(blocks),
                len(keys),
                *self.peer,
                exc,
            )
        return blocks

    def save(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> None:
        assert self.server is not None
        store = self.server.store
        for key, block in zip(keys, blocks, strict=True):
            store.put(bytes.fromhex(key), block.contiguous().view(torch.uint8).numpy().tobytes())

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
