"""Data-parallel replicas as Ray actors (``--data-parallel-backend ray``).

Each replica is a Ray actor placed by one placement group with a bundle per replica (its
share of the CPUs), so the replicas may run on any node of the Ray cluster at
``RAY_ADDRESS`` (or of a Ray instance started on this machine). Inside its actor, a
replica runs exactly as a process of the ``mp`` backend does
(:func:`~pagedllm.entrypoints.data_parallel.replica.replica_main`): it listens for the
front ends on its node's address. Its status channel, the pipe of an ``mp`` replica, is
a connection back to the server (a listener with the replicas' key), which closes when
the actor is gone: the server watches it as it watches an ``mp`` replica's process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from pagedllm.core.errors import ConfigError

logger = logging.getLogger("pagedllm.replica")


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--data-parallel-backend ray needs Ray: pip install 'pagedllm[ray]'"
        ) from None
    return ray


class RayReplicaActor:
    """The actor a replica runs in (see the module docstring)."""

    def run(self, spec: Any, server: tuple[str, int], authkey: bytes) -> int:
        """Call the server back, then run the replica until it is told to stop; its exit
        code. (On the actor's main thread, where Ray runs a task: the replica sets its
        signal handling as a process of its own does.)"""
        import ray

        from pagedllm.entrypoints.data_parallel.replica import replica_main

        status = Client(server, authkey=authkey)
        status.send(("hello", spec.index, os.getpid()))
        node = ray.util.get_node_ip_address()
        # (front ends on other nodes reach it at its node's address)
        spec = dataclasses.replace(spec, host=node, advertised_host=node)
        try:
            replica_main(spec, status)
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0


class RayReplicaProcess:
    """A replica's actor, with what the server uses of a replica process: ``pid``,
    ``is_alive()``, ``exitcode``, ``join()``, ``kill()`` and a ``sentinel`` (its status
    connection, which turns readable when the actor is gone)."""

    def __init__(self, ray: Any, actor: Any, done: Any) -> None:
        self.ray = ray
        self.actor = actor
        # The actor's run() (done when the replica exits).
        self.done = done
        self.pid: int | None = None
        self.conn: Connection | None = None
        self.connected = threading.Event()

    @property
    def sentinel(self) -> Connection:
        assert self.conn is not None, "the replica has not called back"
        return self.conn

    def is_alive(self) -> bool:
        ready, _ = self.ray.wait([self.done], timeout=0)
        return not ready

    @property
    def exitcode(self) -> int | None:
        if self.is_alive():
            return None
        try:
            return int(self.ray.get(self.done))
        except Exception:  # (the actor died: killed, or its process failed)
            return 1

    def join(self, timeout: float | None = None) -> None:
        self.ray.wait([self.done], timeout=timeout)

    def kill(self) -> None:
        self.ray.kill(self.actor)


class _StatusConnection:
    """A replica's status connection before its actor has called back: ``poll`` waits
    for the call (and says no message yet), the rest waits for it too."""

    def __init__(self, proc: RayReplicaProcess) -> None:
        self.proc = proc

    def _conn(self, timeout: float | None = None) -> Connection | None:
        if not self.proc.connected.wait(timeout):
            return None
        return self.proc.conn

    def poll(self, timeout: float = 0.0) -> bool:
        conn = self._conn(timeout)
        if conn is None:
            if not self.proc.is_alive():  # (it died before calling back: an EOF)
                return True
            return False
        return conn.poll(timeout)

    def recv(self) -> Any:
        conn = self._conn(0)
        if conn is None:
            raise EOFError("the replica's actor exited before it called back")
        return conn.recv()

    def send(self, message: Any) -> None:
        conn = self._conn(0)
        if conn is None:
            raise OSError("the replica's actor has not called back")
        conn.send(message)

    def fileno(self) -> int:
        conn = self._conn()
        assert conn is not None
        return conn.fileno()

    def close(self) -> None:
        conn = self._conn(0)
        if conn is not None:
            conn.close()


class RayReplicas:
    """The replicas of ``specs`` started as Ray actors: ``procs`` and ``status`` as
    :class:`~pagedllm.entrypoints.data_parallel.replica_group.ReplicaGroup` keeps them
    for its ``mp`` processes."""

    def __init__(self, specs: list[Any], authkey: bytes, threads: int, device: Any) -> None:
        if device.name != "cpu":
            raise ConfigError(
                f"--data-parallel-backend ray is not supported on the {device.name} device "
                "yet (only the cpu's replicas are placed by Ray); use mp"
            )
        ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray = ray
        if not ray.is_initialized():
            ray.init(logging_level=logging.WARNING, log_to_driver=True)
        host = ray.util.get_node_ip_address()
        self.listener = Listener((host, 0), authkey=authkey)
        bundle = {"CPU": threads}
        self.group = placement_group([bundle] * len(specs))
        try:
            ray.get(self.group.ready(), timeout=120)
        except Exception as exc:
            self.close()
            raise ConfigError(
                f"--data-parallel-backend ray: the Ray cluster has no room for "
                f"{len(specs)} replica(s) of {bundle}: {exc}"
            ) from exc
        actor_cls = ray.remote(num_cpus=threads)(RayReplicaActor)
        self.procs: list[RayReplicaProcess] = []
        for bundle_index, spec in enumerate(specs):
            actor = actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.group, placement_group_bundle_index=bundle_index
                ),
                name=None,
            ).remote()
            done = actor.run.remote(spec, self.listener.address, authkey)
            self.procs.append(RayReplicaProcess(ray, actor, done))
        self.status: list[Any] = [_StatusConnection(proc) for proc in self.procs]
        self._first = specs[0].index
        self._closed = False
        self._accepting = threading.Thread(
            target=self._accept, name="pagedllm-ray-replicas", daemon=True
        )
        self._accepting.start()

    def _accept(self) -> None:
        """Take each actor's call back (its index says which replica it is)."""
        waiting = set(self.procs)
        while waiting:
            try:
                conn = self.listener.accept()
                _, index, pid = conn.recv()
            except (OSError, EOFError, ValueError, AuthenticationError) as exc:
                if self._closed or not any(p.is_alive() for p in waiting):
                    return
                logger.debug("a replica's call back failed: %s", exc)
                continue
            proc = self.procs[index - self._first]
            proc.conn, proc.pid = conn, pid
            proc.connected.set()
            waiting.discard(proc)

    def close(self) -> None:
        """Stop the actors (after the replicas were told to stop) and free their room."""
        self._closed = True
        for proc in getattr(self, "procs", []):
            proc.kill()
        try:
            self.listener.close()
        except OSError:
            pass
        group = getattr(self, "group", None)
        if group is not None:
            self.ray.util.remove_placement_group(group)
