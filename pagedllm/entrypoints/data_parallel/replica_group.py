"""The data-parallel replica processes, from the side of the process that starts them
(the server): started together, waited for, stopped (see :mod:`.replica`)."""

from __future__ import annotations

import atexit
import logging
import os
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError, EngineDeadError
from pagedllm.entrypoints.data_parallel.replica import (
    EngineFacts,
    ReplicaSpec,
    error_from_wire,
    replica_main,
)

if TYPE_CHECKING:
    import multiprocessing.process

    from pagedllm.core.config import PagedLLMConfig

logger = logging.getLogger("pagedllm.replica")

# How long the parent waits for a replica to load its model.
LOAD_TIMEOUT_S = 600.0


class ReplicaGroup:
    """The replica processes of this node, started at once (they load their models
    together): replicas ``first`` to ``first + count - 1`` of the data-parallel size (by
    default all of this node's, from 0), listening on ``host`` (told to front ends as
    ``advertised_host``). On the head node of several (``--data-parallel-size-local``
    below the size), :meth:`wait_ready` also waits for the other nodes' replicas to
    register (:class:`~pagedllm.entrypoints.data_parallel.replica_nodes.RemoteReplicas`), and
    ``addresses`` lists every replica's, in order.

    Not daemonic: a replica with ``-tp`` ranks starts their processes, which a daemonic
    process may not. They stop on :meth:`stop`, and on their own when this process is
    gone (their status pipe closes), so none outlives the server."""

    def __init__(
        self,
        config: PagedLLMConfig,
        first: int = 0,
        count: int | None = None,
        host: str = "127.0.0.1",
        advertised_host: str | None = None,
    ) -> None:
        import multiprocessing

        from pagedllm.entrypoints.data_parallel.replica_nodes import (
            RemoteReplicas,
            data_parallel_key,
        )

        parallel = config.parallel_config
        self.size = parallel.data_parallel_size
        self.first = first
        self.count = parallel.local_replicas if count is None else count
        # (replicas of several nodes share the key their front ends connect with)
        multi_node = self.count < self.size
        self.authkey = data_parallel_key() if multi_node else os.urandom(32)
        device = config.device_config.device
        threads = max(1, device.num_threads() // self.count)
        gpus = _visible_gpus() if device.name == "cuda" else None
        ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        context = multiprocessing.get_context("spawn")
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.status: list[Connection] = []
        self.addresses: list[Any] = []
        self.facts: EngineFacts | None = None
        self._stopped = False
        # The head node's registrations of the other nodes' replicas.
        self.remote: RemoteReplicas | None = None
        # --data-parallel-backend ray: the replicas' actors.
        self.ray: Any = None
        specs = [
            ReplicaSpec(
                config,
                first + local,
                self.size,
                self.authkey,
                threads,
                ",".join(gpus[local * ranks : (local + 1) * ranks]) if gpus else None,
                host,
                advertised_host,
            )
            for local in range(self.count)
        ]
        try:
            if multi_node and first == 0:
                self.remote = RemoteReplicas(parallel, self.authkey, self.count)
            if parallel.data_parallel_backend == "ray":
                from pagedllm.entrypoints.data_parallel.ray_replicas import RayReplicas

                self.ray = RayReplicas(specs, self.authkey, threads, device)
                self.procs, self.status = list(self.ray.procs), list(self.ray.status)
            for spec in specs if self.ray is None else ():
                parent, child = context.Pipe()
                proc = context.Process(
                    target=replica_main,
                    args=(spec, child),
                    name=f"pagedllm-dp-replica-{spec.index}",
                    daemon=False,
                )
                proc.start()
                child.close()
                self.procs.append(proc)
                self.status.append(parent)
        except BaseException:
            self.stop()
            raise
        # (Before multiprocessing's own exit handler, which would wait for them forever.)
        atexit.register(self.stop)
        logger.info(
            "data parallelism: %d engine replicas (%s), %d threads each%s",
            self.count,
            "Ray actors"
            if self.ray is not None
            else "processes " + ", ".join(str(p.pid) for p in self.procs),
            threads,
            f"; replicas {first}..{first + self.count - 1} of {self.size}" if multi_node else "",
        )

    def wait_ready(self, timeout: float = LOAD_TIMEOUT_S) -> None:
        """Wait until every replica of this node has loaded its model and listens (on the
        head node of several, until the others' have registered too); a replica that
        fails or exits meanwhile raises (what it raised, when it said)."""
        deadline = time.monotonic() + timeout
        statuses = zip(self.procs, self.status, strict=True)
        for index, (proc, conn) in enumerate(statuses, self.first):
            while not conn.poll(0.2):
                # (Any replica: one that fails early is not left until the others load.)
                self._raise_if_one_exited()
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"data-parallel replica {index}: not ready in time")
            try:
                kind, *detail = conn.recv()
            except (EOFError, OSError):
                proc.join(5)
                raise EngineDeadError(
                    f"data-parallel replica {index} exited (code {proc.exitcode}) while "
                    "loading the model"
                ) from None
            if kind == "error":
                error = error_from_wire(*detail)
                if isinstance(error, ConfigError):
                    raise error
                raise EngineDeadError(f"data-parallel replica {index} failed to start: {error}")
            address, facts = detail
            self.addresses.append(address)
            if self.facts is None:
                self.facts = facts
        if self.remote is not None:
            assert self.facts is not None
            remote = self.remote.wait(self.facts, deadline, self._raise_if_one_exited)
            self.addresses += [remote[index] for index in range(self.count, self.size)]

    def _raise_if_one_exited(self) -> None:
        for number, proc in enumerate(self.procs):
            if not proc.is_alive():
                self._raise_failed(number)

    def _raise_failed(self, index: int) -> None:
        """Raise what this node's replica ``index`` (from 0), which exited, said (or its
        exit code)."""
        conn, proc = self.status[index], self.procs[index]
        index += self.first
        try:
            while conn.poll(0):
                kind, *detail = conn.recv()
                if kind == "error":
                    error = error_from_wire(*detail)
                    if isinstance(error, ConfigError):
                        raise error
                    raise EngineDeadError(f"data-parallel replica {index} failed to start: {error}")
        except (EOFError, OSError):
            pass
        raise EngineDeadError(
            f"data-parallel replica {index} exited (code {proc.exitcode}) while loading the model"
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every replica (each aborts its requests and stops its -tp ranks), killing
        one that does not exit in ``timeout`` seconds."""
        if self._stopped:
            return
        self._stopped = True
        if self.remote is not None:
            self.remote.stop()
        for conn in self.status:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                logger.warning("data-parallel replica %s did not stop; killing it", proc.pid)
                proc.kill()
                proc.join(5)
        for conn in self.status:
            conn.close()
        if self.ray is not None:
            self.ray.close()


def _visible_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [g.strip() for g in visible.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]
