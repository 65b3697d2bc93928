"""``DataParallelClient``: a front end's engine when the engines are data-parallel
replica processes (:mod:`pagedllm.entrypoints.data_parallel.replica`), with the interface the server
uses (:class:`~pagedllm.core.engine_client.EngineClient`).

Each request group goes to the replica with the least load: what the replica last
reported (its unfinished requests, from every front end) plus the requests this front end
sent it that the report did not include yet; ties go round the replicas in turn. One
reader thread per replica hands the outputs to the asyncio callers.

A replica that goes away (its connection closes) cannot come back: its requests fail,
``/health`` answers 503 at once, and ``dead`` is set :data:`DEAD_GRACE_S` later, so that
whatever polls ``/health`` sees the 503 before the server exits non-zero.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import pickle
import threading
from collections.abc import AsyncIterator, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import EngineDeadError
from pagedllm.entrypoints.data_parallel.connections import connect
from pagedllm.entrypoints.data_parallel.replica import EngineFacts, error_from_wire
from pagedllm.entrypoints.data_parallel.replica_group import ReplicaGroup

if TYPE_CHECKING:
    from pagedllm.core.config import PagedLLMConfig
    from pagedllm.core.engine import NewRequest
    from pagedllm.core.outputs import RequestOutput
    from pagedllm.lora.request import LoRARequest

logger = logging.getLogger("pagedllm.replica_client")

# How long /health answers 503 after a replica died, before the server exits.
DEAD_GRACE_S = 3.0


@dataclasses.dataclass(slots=True)
class _Group:
    """Where one request group's outputs go: its caller's queue, from a reader thread."""

    replica: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException]
    # Each request's prompt fields, from its first output (the replica sends them once).
    prompts: dict[str, tuple[Any, Any, Any]] = dataclasses.field(default_factory=dict)

    def put(self, item: tuple[int, RequestOutput] | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaAddresses:
    """How a front end reaches the replicas (picklable, for front-end processes)."""

    addresses: tuple[Any, ...]
    authkey: bytes
    facts: EngineFacts


class DataParallelClient:
    """The replicas behind one front end. With ``group`` (``-dp N`` and one front end,
    this process) the client owns the replica processes: :meth:`wait_built` waits for
    them and :meth:`shutdown` stops them. With ``replicas`` (a front-end process of
    ``--api-server-count``) it only connects; the parent owns them."""

    def __init__(
        self,
        config: PagedLLMConfig,
        *,
        group: ReplicaGroup | None = None,
        replicas: ReplicaAddresses | None = None,
    ) -> None:
        assert (group is None) != (replicas is None)
        self.config = config
        self.dead = threading.Event()
        self._group = group
        self._replicas = replicas
        self._lock = threading.Lock()
        self._conns: list[Connection] = []
        self._send_locks: list[threading.Lock] = []
        self._reported: list[int] = []
        self._acked: list[int] = []
        self._sent: list[int] = []
        self._groups: dict[int, _Group] = {}
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._ids = itertools.count()
        self._turn = itertools.count()
        self._failure: str | None = None
        self._stopped = False

    @classmethod
    def start(cls, config: PagedLLMConfig) -> DataParallelClient:
        """Start the replicas (they load while the caller goes on)."""
        return cls(config, group=ReplicaGroup(config))

    def wait_built(self) -> None:
        """Wait for the replicas (when owned) and connect to each."""
        if self._conns:
            return
        if self._group is not None:
            try:
                self._group.wait_ready()
            except BaseException:
                self._group.stop()
                raise
            assert self._group.facts is not None
            self._replicas = ReplicaAddresses(
                tuple(self._group.addresses), self._group.authkey, self._group.facts
            )
        assert self._replicas is not None
        for index, address in enumerate(self._replicas.addresses):
            conn = connect(address, self._replicas.authkey)
            self._conns.append(conn)
            self._send_locks.append(threading.Lock())
            self._reported.append(0)
            self._acked.append(0)
            self._sent.append(0)
            threading.Thread(
                target=self._read, args=(index, conn), name=f"pagedllm-replica-{index}",
                daemon=True,
            ).start()  # fmt: skip

    @property
    def replicas(self) -> ReplicaAddresses:
        """The replicas' addresses, for front-end processes (after :meth:`wait_built`)."""
        assert self._replicas is not None
        return self._replicas

    @property
    def engine(self) -> EngineFacts:
        return self.replicas.facts

    @property
    def num_replicas(self) -> int:
        return len(self._conns)

    @property
    def is_healthy(self) -> bool:
        return bool(self._conns) and self._failure is None and not self._stopped

    # ------------------------------------------------------------ reader threads

    def _read(self, index: int, conn: Connection) -> None:
        while True:
            try:
                load, acked, events = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self._lost(index)
                return
            with self._lock:
                self._reported[index], self._acked[index] = load, acked
            for event in events:
                self._dispatch(event)

    def _dispatch(self, event: tuple[Any, ...]) -> None:
        kind = event[0]
        if kind == "out":
            _, group_id, index, output = event
            group = self._groups.get(group_id)
            if group is not None:
                prompt = group.prompts.get(output.request_id)
                if prompt is None:
                    group.prompts[output.request_id] = (
                        output.prompt,
                        output.prompt_token_ids,
                        output.prompt_logprobs,
                    )
                else:
                    output.prompt, output.prompt_token_ids, output.prompt_logprobs = prompt
                group.put((index, output))
        elif kind == "fail":
            _, group_id, *error = event
            group = self._groups.get(group_id)
            if group is not None:
                group.put(error_from_wire(*error))
        elif kind == "reply":
            _, call_id, ok, value = event
            with self._lock:
                future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(error_from_wire(*value))

    def _lost(self, index: int) -> None:
        """Replica ``index`` is gone: fail what waits on it, answer 503, exit soon."""
        with self._lock:
            if self._stopped or self._failure is not None:
                return
            self._failure = f"data-parallel replica {index} exited"
            groups = list(self._groups.values())
            calls = list(self._calls.values())
        logger.critical("%s; the server stops serving", self._failure)
        for group in groups:
            group.put(EngineDeadError(self._failure))
        for future in calls:
            if not future.done():
                future.set_exception(EngineDeadError(self._failure))
        timer = threading.Timer(DEAD_GRACE_S, self.dead.set)
        timer.daemon = True
        timer.start()

    # ------------------------------------------------------------------ sending

    def _check(self) -> None:
        if self._stopped:
            raise EngineDeadError("the server is shutting down")
        if self._failure is not None:
            raise EngineDeadError(self._failure)

    def _send(self, index: int, data: bytes) -> None:
        try:
            with self._send_locks[index]:
                self._conns[index].send_bytes(data)
        except OSError as exc:
            raise EngineDeadError(f"data-parallel replica {index} is gone: {exc}") from exc

    def _least_loaded(self) -> int:
        """(Under the lock.) The replica with the fewest unfinished requests, counting
        those sent to it that it has not reported yet."""
        n = len(self._conns)
        start = next(self._turn) % n
        order = [(start + i) % n for i in range(n)]
        return min(order, key=lambda i: self._reported[i] + self._sent[i] - self._acked[i])

    async def generate_many(
        self, requests: Sequence[NewRequest]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """As :meth:`AsyncLLMEngine.generate_many`, on the least loaded replica (the
        group stays together: one invalid request queues none)."""
        self._check()
        group_id = next(self._ids)
        data = pickle.dumps(("add", group_id, list(requests)), protocol=pickle.HIGHEST_PROTOCOL)
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        with self._lock:  # (checked with the group registered: a failure reaches it)
            self._check()
            replica = self._least_loaded()
            self._sent[replica] += len(requests)
            self._groups[group_id] = _Group(replica, asyncio.get_running_loop(), queue)
        unfinished = {r.request_id for r in requests}
        try:
            self._send(replica, data)
            while unfinished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    unfinished.clear()  # (the replica has forgotten the group)
                    raise item
                index, output = item
                if output.finished:
                    unfinished.discard(output.request_id)
                yield index, output
        finally:
            with self._lock:
                self._groups.pop(group_id, None)
            if unfinished and self.is_healthy:
                try:
                    self._send(replica, pickle.dumps(("abort", group_id)))
                except EngineDeadError:
                    pass

    def _call(self, index: int, op: str, argument: Any = None) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = next(self._ids)
        data = pickle.dumps(("call", call_id, op, argument), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._lock:
                self._check()
                self._calls[call_id] = future
            self._send(index, data)
        except EngineDeadError as exc:
            with self._lock:
                self._calls.pop(call_id, None)
            future.set_exception(exc)
        return future

    def _call_all(self, op: str, argument: Any = None) -> concurrent.futures.Future[list[Any]]:
        """``op`` on every replica: their answers in replica order, or the first error."""
        futures = [self._call(i, op, argument) for i in range(len(self._conns))]
        combined: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()

        def done(_: Any) -> None:
            if combined.done() or not all(f.done() for f in futures):
                return
            errors = [f.exception() for f in futures if f.exception() is not None]
            try:
                if errors:
                    combined.set_exception(errors[0])
                else:
                    combined.set_result([f.result() for f in futures])
            except concurrent.futures.InvalidStateError:  # (set by another callback)
                pass

        for future in futures:
            future.add_done_callback(done)
        return combined

    # ------------------------------------------------------------------ the rest

    def load_lora(self, request: LoRARequest) -> concurrent.futures.Future[Any]:
        """Load the adapter on every replica (each would load it with its first request
        anyway; this refuses a bad one up front)."""
        return self._call_all("load_lora", request)

    def unload_lora(self, lora_int_id: int) -> concurrent.futures.Future[Any]:
        return self._call_all("unload_lora", lora_int_id)

    def metric_families(self) -> concurrent.futures.Future[list[list[Any]]]:
        """Each replica's Prometheus metric families, in replica order."""
        return self._call_all("metrics")

    def stop_compiling(self) -> None:
        for index in range(len(self._conns)):
            try:
                self._send(index, pickle.dumps(("call", -1, "stop_compiling", None)))
            except EngineDeadError:
                pass

    def shutdown(self, timeout: float = 10.0) -> None:
        """Disconnect (a replica aborts the requests of a front end that leaves) and, when
        this client owns the replicas, stop them; waiting requests fail."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            groups = list(self._groups.values())
            calls = list(self._calls.values())
        for conn in self._conns:
            conn.close()
        for group in groups:
            group.put(EngineDeadError("the server is shutting down"))
        for future in calls:
            if not future.done():
                future.set_exception(EngineDeadError("the server is shutting down"))
        if self._group is not None:
            self._group.stop(timeout)
