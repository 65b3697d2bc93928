"""Data-parallel replicas on several nodes (vLLM's multi-node data parallelism).

The head node runs ``pagedllm serve MODEL -dp N -dpl L [-dpa ADDRESS] [-dpp PORT]``: its
API server, and replicas 0 to L - 1. Every other node runs ``pagedllm serve MODEL
--headless -dp N -dpl K -dpr S -dpa HEAD -dpp PORT``: replicas S to S + K - 1 and no API
server. A headless node's replicas listen on every interface; once they have loaded, the
node registers them (their addresses) with the head node at ``HEAD:PORT``, and the head's
front ends connect to them as to its own (:mod:`pagedllm.entrypoints.data_parallel.replica_client`):
requests go to the least loaded replica of any node.

The connections are authenticated with a secret every node is given,
``PAGEDLLM_DATA_PARALLEL_KEY`` (the replicas take pickled messages: whoever holds the key
may send them). The head node starts serving once every replica has registered; a node
whose replicas differ from the head's (another model or context length) or that claims
replicas already taken is refused. A headless node stops when the head node stops (or
is gone), and the head stops serving when a replica of any node is gone, as with one
node; the connections (:mod:`pagedllm.entrypoints.data_parallel.connections`) have TCP
keep-alive, so a node that vanishes without closing them is noticed too.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError, EngineDeadError
from pagedllm.entrypoints.data_parallel.connections import AuthenticatedListener

if TYPE_CHECKING:
    from pagedllm.core.config import ParallelConfig
    from pagedllm.entrypoints.data_parallel.replica import EngineFacts

logger = logging.getLogger("pagedllm.replica")

KEY_VARIABLE = "PAGEDLLM_DATA_PARALLEL_KEY"
# --data-parallel-rpc-port's default (vLLM's).
DEFAULT_RPC_PORT = 29550
# How long a registration may take to arrive once connected.
REGISTER_TIMEOUT_S = 30.0


def data_parallel_key() -> bytes:
    """The secret the nodes' replicas and front ends authenticate each other with."""
    key = os.environ.get(KEY_VARIABLE, "")
    if not key:
        raise ConfigError(
            f"data-parallel replicas on several nodes (--data-parallel-size-local below "
            f"--data-parallel-size, or --headless) authenticate each other with a shared "
            f"secret: set {KEY_VARIABLE} to the same value on every node"
        )
    return key.encode()


def rpc_address(parallel: ParallelConfig, default_host: str) -> tuple[str, int]:
    """The head node's registration address (``default_host`` without -dpa)."""
    host = parallel.data_parallel_address or default_host
    return host, parallel.data_parallel_rpc_port or DEFAULT_RPC_PORT


def advertised_host(head: tuple[str, int]) -> str:
    """The address the head node reaches this one at: ``PAGEDLLM_HOST_IP`` (or
    ``VLLM_HOST_IP``) where set, else this node's address on the route to the head."""
    for variable in ("PAGEDLLM_HOST_IP", "VLLM_HOST_IP"):
        if os.environ.get(variable):
            return os.environ[variable]
    try:
        family, _, _, _, address = socket.getaddrinfo(*head, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)  # (a UDP "connect" sends nothing: it picks the route)
            return probe.getsockname()[0]
    except OSError as exc:
        raise ConfigError(
            f"--data-parallel-address {head[0]}: cannot find this node's address on the "
            f"route to it ({exc}); set PAGEDLLM_HOST_IP to the address the head node "
            "reaches this node at"
        ) from None


def fingerprint(facts: EngineFacts) -> tuple[Any, ...]:
    """What must be the same for every replica: the task, the context, the vocabulary,
    the settings the outputs depend on (dtype, quantization, adapters) and the model's
    configuration (not where it was read from, nor the transformers version)."""
    config = facts.loaded.hf_config.to_dict()
    for local in ("_name_or_path", "transformers_version"):
        config.pop(local, None)
    described = json.dumps(config, sort_keys=True, default=str)
    return facts.task, facts.max_model_len, facts.vocab_size, facts.settings, described


class RemoteReplicas:
    """The head node's side: listens at ``-dpa:-dpp`` for the headless nodes, which
    register replicas ``first`` to the data-parallel size - 1, and keeps their
    connections (a stop goes to each)."""

    def __init__(self, parallel: ParallelConfig, authkey: bytes, first: int) -> None:
        self.size, self.first = parallel.data_parallel_size, first
        host, port = rpc_address(parallel, "0.0.0.0")
        self.nodes: list[Connection] = []
        self._arrived: queue.Queue[Connection] = queue.Queue()
        # Set once every replica has registered: a node registering after is refused.
        self._complete = False
        self._lock = threading.Lock()
        try:
            self.listener = AuthenticatedListener(
                (host, port), authkey, self._arrive, "pagedllm-dp-register"
            )
        except OSError as exc:
            raise ConfigError(
                f"--data-parallel-address {host} --data-parallel-rpc-port {port}: "
                f"{exc.strerror or exc}"
            ) from None
        logger.info(
            "waiting for data-parallel replicas %d..%d to register at %s:%d",
            first,
            self.size - 1,
            host,
            port,
        )

    def _arrive(self, conn: Connection) -> None:
        with self._lock:
            if not self._complete:
                self._arrived.put(conn)
                return
        _send_and_close(conn, ("refused", "every replica has registered already"))

    def wait(self, facts: EngineFacts, deadline: float, check: Any) -> dict[int, Any]:
        """Each remote replica's address, once all have registered (their replicas the
        same as ``facts``' replica's); ``check()`` raises when this node's replicas fail
        meanwhile."""
        expected = fingerprint(facts)
        addresses: dict[int, Any] = {}
        while len(addresses) < self.size - self.first:
            check()
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.first, self.size)) - set(addresses))
                raise EngineDeadError(
                    f"data-parallel replicas {missing} did not register in time (start "
                    "them with `pagedllm serve MODEL --headless ...` on the other nodes)"
                )
            try:
                conn = self._arrived.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                if not conn.poll(REGISTER_TIMEOUT_S):
                    raise EOFError("no registration")
                kind, size, replicas, theirs = conn.recv()
                if kind != "register" or not isinstance(replicas, dict):
                    raise ValueError(f"not a registration: {kind!r}")
            except Exception as exc:  # (a peer with the key but not a headless node)
                logger.warning("a registration was not understood: %r", exc)
                conn.close()
                continue
            problem = self._problem(size, replicas, theirs, expected, addresses)
            if problem is not None:
                logger.error("a headless node was refused: %s", problem)
                _send_and_close(conn, ("refused", problem))
                continue
            conn.send(("ok",))
            self.nodes.append(conn)
            addresses.update(replicas)
            logger.info("data-parallel replicas %s registered", sorted(replicas))
        with self._lock:
            self._complete = True
        while not self._arrived.empty():  # (any that arrived meanwhile)
            self._arrive(self._arrived.get())
        return addresses

    def _problem(
        self,
        size: int,
        replicas: dict[int, Any],
        theirs: tuple[Any, ...],
        expected: tuple[Any, ...],
        addresses: dict[int, Any],
    ) -> str | None:
        if size != self.size:
            return f"its --data-parallel-size is {size}, the head node's {self.size}"
        wanted = set(range(self.first, self.size))
        for index in replicas:
            if index not in wanted:
                return (
                    f"its replica {index} is not one of the head node's others "
                    f"({self.first}..{self.size - 1})"
                )
            if index in addresses:
                return f"replica {index} is registered already"
        if theirs != expected:
            return (
                "its replicas serve another model than the head node's, or with other "
                "settings (model configuration, context length, task, dtype, quantization "
                "or LoRA settings)"
            )
        return None

    def stop(self) -> None:
        """Tell the headless nodes to stop; stop listening."""
        with self._lock:
            self._complete = True
        self.listener.close()
        for conn in self.nodes:
            _send_and_close(conn, ("stop",))


def _send_and_close(conn: Connection, message: tuple[Any, ...]) -> None:
    try:
        conn.send(message)
    except OSError:
        pass
    conn.close()
