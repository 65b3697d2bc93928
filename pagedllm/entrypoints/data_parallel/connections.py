"""Authenticated connections between the data-parallel processes and nodes
(``multiprocessing.connection`` messages and key handshake), made so that a peer cannot
hold the others up: each accepted connection's handshake runs on its own thread and
must finish within :data:`HANDSHAKE_TIMEOUT_S` (a port scanner that connects and says
nothing delays no one), connecting has a timeout too, and every connection has TCP
keep-alive, so that a peer whose machine vanished (power, network) is noticed as a
closed connection within about half a minute instead of never.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

logger = logging.getLogger("pagedllm.replica")

HANDSHAKE_TIMEOUT_S = 10.0
# TCP keep-alive: probes after this many idle seconds, then every interval, and the
# connection fails after count unanswered ones.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3


def keep_alive(sock: socket.socket) -> None:
    """Turn on TCP keep-alive with short probe times (where the platform has them)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_COUNT),
    ):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _authenticate(sock: socket.socket, authkey: bytes, server: bool, timeout: float) -> Connection:
    """A connection over ``sock`` once the key handshake has passed (both ways), which
    must take at most ``timeout`` seconds: the socket is shut down when it has not by
    then (the handshake then fails)."""
    keep_alive(sock)
    sock.settimeout(None)
    conn = Connection(os.dup(sock.fileno()))
    done = threading.Event()

    def expire() -> None:
        if not done.is_set():
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        if server:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        else:
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)
        done.set()
    except BaseException:
        conn.close()
        raise
    finally:
        timer.cancel()
        sock.close()  # (the connection holds its own descriptor)
    return conn


def connect(
    address: tuple[str, int], authkey: bytes, timeout: float = HANDSHAKE_TIMEOUT_S
) -> Connection:
    """An authenticated connection to a :class:`AuthenticatedListener` (or a
    ``multiprocessing.connection.Listener``) at ``address``; ``OSError`` when nobody
    listens there or it does not answer in ``timeout`` seconds,
    ``multiprocessing.AuthenticationError`` when its key differs."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        return _authenticate(sock, authkey, server=False, timeout=timeout)
    except EOFError as exc:
        raise ConnectionError(f"{address[0]}:{address[1]} closed the connection") from exc


class AuthenticatedListener:
    """Listens at ``address`` (port 0: any free one); calls ``on_connection(conn)`` for
    each connection whose key handshake passed, on that connection's own thread.
    ``address`` afterwards is where it listens."""

    def __init__(
        self,
        address: tuple[str, int],
        authkey: bytes,
        on_connection: Callable[[Connection], Any],
        name: str,
    ) -> None:
        host = address[0]
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server(address, family=family)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.authkey = authkey
        self.on_connection = on_connection
        self.name = name
        self.closed = False
        threading.Thread(target=self._accept, name=name, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.sock.accept()
            except OSError:  # (closed)
                return
            threading.Thread(
                target=self._handshake, args=(sock,), name=f"{self.name}-handshake", daemon=True
            ).start()

    def _handshake(self, sock: socket.socket) -> None:
        try:
            conn = _authenticate(sock, self.authkey, server=True, timeout=HANDSHAKE_TIMEOUT_S)
        except Exception as exc:  # (another key, a stray or silent connection)
            if not self.closed:
                logger.warning("%s: a connection was refused: %r", self.name, exc)
            return
        if self.closed:
            conn.close()
            return
        self.on_connection(conn)

    def close(self) -> None:
        """Stop listening (the accepting thread ends)."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
