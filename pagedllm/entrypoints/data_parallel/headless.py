"""``pagedllm serve --headless``: a node that runs some of the data-parallel replicas
for another node's API server and registers them with it (see
:mod:`pagedllm.entrypoints.data_parallel.replica_nodes`)."""

from __future__ import annotations

import logging
import signal
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError, EngineDeadError
from pagedllm.entrypoints.data_parallel.connections import connect
from pagedllm.entrypoints.data_parallel.replica_group import LOAD_TIMEOUT_S, ReplicaGroup
from pagedllm.entrypoints.data_parallel.replica_nodes import (
    KEY_VARIABLE,
    REGISTER_TIMEOUT_S,
    advertised_host,
    data_parallel_key,
    fingerprint,
    rpc_address,
)

if TYPE_CHECKING:
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.plugins import PluginManager
    from pagedllm.entrypoints.openai.cli_args import FrontendArgs

logger = logging.getLogger("pagedllm.replica")


def serve_headless(engine_args: EngineArgs, options: FrontendArgs, pm: PluginManager) -> int:
    """``pagedllm serve --headless``: this node's replicas, registered with the head node,
    until the head node stops (0), or is gone or a replica exits (1)."""
    from pagedllm.core.config import UsageContext

    first, size = options.data_parallel_start_rank, engine_args.data_parallel_size
    if size == 1:
        raise ConfigError(
            "--headless runs data-parallel replicas for a head node's API server: give "
            "--data-parallel-size above 1"
        )
    if engine_args.data_parallel_size_local is None:  # (the replicas from the start rank)
        engine_args.data_parallel_size_local = max(1, size - first)
    count = engine_args.data_parallel_size_local
    if first < 1 or first + count > size:
        raise ConfigError(
            f"--data-parallel-start-rank {first} with --data-parallel-size-local {count}: a "
            f"--headless node runs some of replicas 1..{size - 1} (the head node runs "
            "those from 0)"
        )
    if engine_args.data_parallel_address is None:
        raise ConfigError("--headless needs --data-parallel-address: the head node's address")
    if options.api_server_count > 1:
        raise ConfigError("--api-server-count: a --headless node runs no API server")
    config = engine_args.create_engine_config(pm, UsageContext.OPENAI_API_SERVER)
    parallel = config.parallel_config
    key = data_parallel_key()
    head = rpc_address(parallel, "")
    group = ReplicaGroup(config, first, count, "0.0.0.0", advertised_host(head))
    stopped: list[int] = []
    previous: dict[int, Any] = {}
    try:
        group.wait_ready()
        assert group.facts is not None
        replicas = dict(zip(range(first, first + count), group.addresses, strict=True))
        conn = _register(head, key, (size, replicas, fingerprint(group.facts)), LOAD_TIMEOUT_S)
        logger.info(
            "data-parallel replicas %d..%d registered with the head node %s:%d",
            first,
            first + count - 1,
            *head,
        )
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda number, _frame: stopped.append(number))
        return _until_done(conn, group, stopped)
    finally:
        group.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _register(
    head: tuple[str, int], key: bytes, registration: tuple[Any, ...], timeout: float
) -> Connection:
    """Register with the head node (waiting for it to listen): the connection, kept."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = connect(head, key)
            break
        except AuthenticationError as exc:
            raise ConfigError(
                f"the head node at {head[0]}:{head[1]} refused this node: {exc} (is "
                f"{KEY_VARIABLE} the same on every node?)"
            ) from None
        except OSError as exc:  # (not listening yet: it may still be loading)
            if time.monotonic() > deadline:
                raise EngineDeadError(
                    f"the head node at {head[0]}:{head[1]} did not take the registration: {exc}"
                ) from None
            time.sleep(1.0)
    try:
        conn.send(("register", *registration))
        # (The head answers once its own replicas have loaded.)
        if not conn.poll(max(REGISTER_TIMEOUT_S, deadline - time.monotonic())):
            raise EOFError("no answer")
        answer = conn.recv()
    except (EOFError, OSError) as exc:
        conn.close()
        raise EngineDeadError(
            f"the head node at {head[0]}:{head[1]} did not answer the registration ({exc})"
        ) from None
    if answer[0] != "ok":
        conn.close()
        raise ConfigError(f"the head node refused this node's replicas: {answer[1]}")
    return conn


def _until_done(conn: Connection, group: Any, stopped: list[int]) -> int:
    sentinels = {proc.sentinel: group.first + i for i, proc in enumerate(group.procs)}
    while not stopped:
        ready = wait([conn, *sentinels], timeout=0.2)
        if conn in ready:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                logger.critical("the head node is gone; stopping this node's replicas")
                return 1
            if message[0] == "stop":
                logger.info("the head node stopped; stopping this node's replicas")
                return 0
        for sentinel in ready:
            if sentinel in sentinels:
                logger.critical("data-parallel replica %d exited", sentinels[sentinel])
                return 1
    logger.info("stopped by %s", signal.Signals(stopped[0]).name)
    return 0
