"""``pagedllm serve --api-server-count N``: N front-end (HTTP) processes on one port, in
front of the engine replicas (``--data-parallel-size``, one engine process without it).

This process binds the port, starts the replicas and, once they are ready, the front
ends, each given the listening socket (the kernel spreads the connections over them) and
connected to every replica. It then supervises: a front end or a replica that exits
stops the server with a non-zero code (after a dead replica, the front ends first answer
503 on ``/health`` for a moment, then exit on their own); SIGINT or SIGTERM stops the
front ends (each finishing its requests), then the replicas, and exits with 0.
"""

from __future__ import annotations

import logging
import logging.config
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from pagedllm.core.config import PagedLLMConfig
    from pagedllm.core.engine_args import EngineArgs
    from pagedllm.core.plugins import PluginManager
    from pagedllm.entrypoints.data_parallel.replica_client import ReplicaAddresses
    from pagedllm.entrypoints.openai.cli_args import FrontendArgs

logger = logging.getLogger("pagedllm.server")

# How long front ends may take to finish their requests and exit once told to.
STOP_TIMEOUT_S = 15.0


def check_front_ends(options: FrontendArgs) -> None:
    """What several front ends cannot do truthfully, refused by name."""
    from pagedllm.entrypoints.openai.routes import runtime_lora_updating

    n = options.api_server_count
    if options.enable_server_load_tracking:
        raise ConfigError(
            f"--enable-server-load-tracking counts the requests of one API server process; "
            f"with --api-server-count {n} each /load would answer for its own share only"
        )
    if runtime_lora_updating():
        raise ConfigError(
            f"PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING: an adapter loaded at run time is known "
            f"to the one API server process that took the request; with --api-server-count "
            f"{n} the others would not serve it (give adapters with --lora-modules)"
        )


def serve_front_ends(
    engine_args: EngineArgs,
    options: FrontendArgs,
    pm: PluginManager,
    log_config: dict[str, Any] | None,
) -> int:
    """Serve with ``options.api_server_count`` front-end processes until a stop signal
    (0) or until a front end or a replica exits (1)."""
    from pagedllm.core.args.checks import invalid_values
    from pagedllm.core.config import UsageContext
    from pagedllm.entrypoints.data_parallel.replica_client import ReplicaAddresses
    from pagedllm.entrypoints.data_parallel.replica_group import ReplicaGroup
    from pagedllm.entrypoints.openai.chat_utils import load_chat_template

    problems = invalid_values(options)
    if problems:
        raise ConfigError("; ".join(problems))
    check_front_ends(options)
    chat_template = load_chat_template(options.chat_template)
    config = engine_args.create_engine_config(pm, UsageContext.OPENAI_API_SERVER)
    # (Bound first: a port in use is refused before any model loads.)
    sock = _listen(options.host or "0.0.0.0", options.port)
    stopped_by: list[int] = []
    previous: dict[int, Any] = {}
    group = ReplicaGroup(config)
    try:
        group.wait_ready()
        assert group.facts is not None
        replicas = ReplicaAddresses(tuple(group.addresses), group.authkey, group.facts)
        # (Until here a stop signal interrupts the loading; from here it stops serving.)
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda number, _frame: stopped_by.append(number))
        front_ends = _start_front_ends(options, config, replicas, chat_template, log_config, sock)
        sock.close()  # (the front ends hold it: once they are gone, the port closes)
        logger.info(
            "serving %s with %d API server processes on %s:%d",
            config.model_config.model,
            len(front_ends),
            options.host or "0.0.0.0",
            options.port,
        )
        return _supervise(front_ends, group, stopped_by)
    finally:
        sock.close()
        group.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--host {host} --port {port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    return sock


def _start_front_ends(
    options: FrontendArgs,
    config: PagedLLMConfig,
    replicas: ReplicaAddresses,
    chat_template: str | None,
    log_config: dict[str, Any] | None,
    sock: socket.socket,
) -> list[tuple[multiprocessing.process.BaseProcess, Connection]]:
    context = multiprocessing.get_context("spawn")
    front_ends = []
    for index in range(options.api_server_count):
        parent, child = context.Pipe()
        proc = context.Process(
            target=front_end_main,
            args=(index, options, config, replicas, chat_template, log_config, sock, child),
            name=f"pagedllm-api-server-{index}",
        )
        proc.start()
        child.close()
        front_ends.append((proc, parent))
    return front_ends


def _supervise(
    front_ends: list[tuple[multiprocessing.process.BaseProcess, Connection]],
    group: Any,
    stopped_by: list[int],
) -> int:
    watched = {proc.sentinel: f"API server process {i}" for i, (proc, _) in enumerate(front_ends)}
    watched |= {proc.sentinel: f"data-parallel replica {i}" for i, proc in enumerate(group.procs)}
    gone = None
    while not stopped_by and gone is None:
        ready = multiprocessing.connection.wait(list(watched), timeout=0.2)
        if ready:
            gone = watched[ready[0]]
    procs = [proc for proc, _ in front_ends]
    if stopped_by:
        logger.info("stopped by %s", signal.Signals(stopped_by[0]).name)
        _stop(procs, 0.0)
        return 0
    logger.critical("the %s exited; stopping the server", gone)
    # (After a replica, the front ends answer 503 for a moment and exit on their own.)
    from pagedllm.entrypoints.data_parallel.replica_client import DEAD_GRACE_S

    _stop(procs, DEAD_GRACE_S + 5.0 if gone.startswith("data-parallel") else 0.0)
    return 1


def _stop(procs: list[multiprocessing.process.BaseProcess], wait: float) -> None:
    """Let the front ends exit within ``wait`` seconds, then SIGTERM them (they finish
    their requests), then kill those still there after :data:`STOP_TIMEOUT_S`."""
    deadline = time.monotonic() + wait
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def front_end_main(
    index: int,
    options: FrontendArgs,
    config: PagedLLMConfig,
    replicas: ReplicaAddresses,
    chat_template: str | None,
    log_config: dict[str, Any] | None,
    sock: socket.socket,
    status: Connection,
) -> None:
    """One front-end process: the OpenAI server on ``sock``, its engine the replicas."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(levelname)s %(asctime)s [api{index}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if log_config is not None:
        logging.config.dictConfig(log_config)
    from pagedllm.core.plugins import make_plugin_manager
    from pagedllm.entrypoints.data_parallel.replica_client import DataParallelClient
    from pagedllm.entrypoints.openai.api_server import run_server
    from pagedllm.entrypoints.openai.serving_setup import PendingServing, validate_frontend_args

    pm = make_plugin_manager()
    validate_frontend_args(options, pm)  # (loads --tool-parser-plugin here too)
    engine = DataParallelClient(config, replicas=replicas)
    pending = PendingServing(config, engine, options, pm, chat_template)

    def watch_parent() -> None:
        try:
            status.recv()
        except (EOFError, OSError):  # the parent is gone: stop as a signal would
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch_parent, name="pagedllm-parent", daemon=True).start()
    sys.exit(run_server(pending, options, pm, log_config, sockets=[sock]))
