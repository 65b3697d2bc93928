"""Data-parallel engine replicas (``pagedllm serve --data-parallel-size N``): each replica
is a process running its own engine (an :class:`~pagedllm.core.async_engine.AsyncLLMEngine`,
so its own model copy, KV cache and ``-tp`` ranks), serving front ends that connect to it.

The protocol is pickled tuples over :mod:`multiprocessing.connection` (a local socket, an
authkey shared through the parent). A front end sends ``("add", group, [NewRequest])``,
``("abort", group)`` and ``("call", id, op, argument)``; the replica answers with
``(load, acked, events)`` messages, where ``load`` is its unfinished requests (from every
front end), ``acked`` the requests it has received from that front end so far, and the
events ``("out", group, index, RequestOutput)`` (the prompt's fields only in a request's
first output), ``("fail", group, *error)`` and
``("reply", id, ok, value)``. A front end's estimate of a replica's load is then exact:
what the replica reported plus what it sent since that the replica had not yet seen.

Multimodal prompts come raw (their decoded images) and are preprocessed by the replica's
engine, on its prepare threads (``AsyncLLMEngine.prepare_prompts``): off its event loop and
its engine thread, with the processor loaded once per replica rather than in every front
end, and no pixel tensors on the wire.

A replica reports its load to every front end whenever it changes, so that front ends
balance on what the others sent too. It exits when its parent says so or is gone (its
status pipe closes), and exits non-zero when its engine loop dies: the front ends see the
connection close and stop serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import pickle
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import (
    ConfigError,
    EngineDeadError,
    InvalidRequestError,
    PagedLLMError,
    RequestFailedError,
)
from pagedllm.entrypoints.data_parallel.connections import AuthenticatedListener

if TYPE_CHECKING:
    from pagedllm.core.async_engine import AsyncLLMEngine
    from pagedllm.core.config import PagedLLMConfig
    from pagedllm.core.engine import LLMEngine
    from pagedllm.core.sampling.defaults import SamplingDefaults

logger = logging.getLogger("pagedllm.replica")


# ------------------------------------------------------------------- shared parts


@dataclasses.dataclass(slots=True)
class LoadedFacts:
    """The parts of ``LoadedModel`` the server reads."""

    sampling_defaults: SamplingDefaults
    eos_token_ids: tuple[int, ...]
    hf_config: Any


@dataclasses.dataclass(slots=True)
class EngineFacts:
    """What a front end without a model needs of it (an
    :class:`~pagedllm.core.engine_client.EngineInfo`), sent once by a replica."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    task: str
    served_tasks: tuple[str, ...]
    loaded: LoadedFacts
    # The engine settings its outputs depend on beyond the model (dtype, quantization,
    # adapters), which the replicas of several nodes must share.
    settings: tuple[Any, ...] = ()

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineFacts:
        loaded = engine.loaded
        config = engine.config
        lora = config.lora_config
        return cls(
            tokenizer=engine.tokenizer,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            task=engine.task,
            served_tasks=engine.served_tasks,
            loaded=LoadedFacts(
                loaded.sampling_defaults, tuple(loaded.eos_token_ids), loaded.hf_config
            ),
            settings=(
                str(loaded.dtype),
                config.model_config.quantization,
                config.cache_config.kv_cache_dtype,
                None if lora is None else repr(lora),
            ),
        )


def wire_error(exc: BaseException) -> tuple[str, str | None, str]:
    """An error as ``(kind, param, message)``: the engine's errors do not all unpickle
    (``InvalidRequestError`` takes two arguments), and the front end must raise the same
    kinds the single-engine server raises (a 400 for an invalid request)."""
    message = str(exc) or repr(exc)
    if isinstance(exc, InvalidRequestError):
        return "invalid", exc.param, exc.message
    if isinstance(exc, EngineDeadError):
        return "dead", None, message
    if isinstance(exc, PagedLLMError):
        return "config", None, message
    if isinstance(exc, ValueError):
        return "value", None, message
    if isinstance(exc, RequestFailedError):
        return "failed", None, message
    return "other", None, f"{type(exc).__name__}: {message}"


def error_from_wire(kind: str, param: str | None, message: str) -> BaseException:
    if kind == "invalid":
        return InvalidRequestError(param, message)
    if kind == "dead":
        return EngineDeadError(message)
    if kind == "config":
        return ConfigError(message)
    if kind == "value":
        return ValueError(message)
    if kind == "failed":
        return RequestFailedError(message)
    return RuntimeError(message)


@dataclasses.dataclass(slots=True)
class ReplicaSpec:
    """What a replica process is started with."""

    config: PagedLLMConfig
    index: int
    size: int
    authkey: bytes
    # The replica's share of the cores (its -tp ranks share it in turn).
    threads: int
    # CUDA_VISIBLE_DEVICES for the replica (its ranks' GPUs), None off cuda.
    visible_devices: str | None
    # Where it listens for front ends, and the host it tells them (another node's front
    # end reaches a replica of a --headless node at this node's address).
    host: str = "127.0.0.1"
    advertised_host: str | None = None


# ------------------------------------------------------------------ the replica's side


def replica_main(spec: ReplicaSpec, status: Connection) -> None:
    """A replica process: build the engine, listen, report ``("ready", address,
    facts)`` (or ``("error", ...)``) on ``status``, then serve until told to stop."""
    # Ctrl+C reaches the whole process group: the parent decides when replicas stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(levelname)s %(asctime)s [dp{spec.index}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # The -tp ranks this replica starts read their share of the cores from here.
    os.environ["OMP_NUM_THREADS"] = str(spec.threads)
    if spec.visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.visible_devices
    import torch

    torch.set_num_threads(spec.threads)
    from pagedllm.core.async_engine import AsyncLLMEngine
    from pagedllm.core.plugins import make_plugin_manager

    try:
        parallel = spec.config.parallel_config.replace(data_parallel_rank=spec.index)
        config = spec.config.replace(parallel_config=parallel)
        engine = AsyncLLMEngine(config, make_plugin_manager())
        replica = Replica(engine, spec.index)
        listener = AuthenticatedListener(
            (spec.host, 0), spec.authkey, replica.connected, f"pagedllm-replica-{spec.index}"
        )
        address = (spec.advertised_host or spec.host, listener.address[1])
        status.send(("ready", address, EngineFacts.of(engine.engine)))
    except BaseException as exc:
        logger.exception("data-parallel replica %d failed to start", spec.index)
        try:
            status.send(("error", *wire_error(exc)))
        except OSError:
            pass
        sys.exit(1)
    code = asyncio.run(replica.serve(status))
    engine.shutdown()
    listener.close()
    sys.exit(code)


@dataclasses.dataclass(eq=False)
class _Peer:
    """One connected front end."""

    conn: Connection
    # Requests received from it so far (reported back as ``acked``).
    acked: int = 0
    outbox: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    sent_load: int = -1
    sent_acked: int = 0
    groups: dict[int, asyncio.Task[None]] = dataclasses.field(default_factory=dict)


class Replica:
    """Serves front ends from an event loop: each request group runs as a task over the
    engine's ``generate_many`` (validation, guided-decoding compiles, aborts on cancel),
    its outputs batched into one message per loop iteration and front end."""

    def __init__(self, engine: AsyncLLMEngine, index: int) -> None:
        from pagedllm.entrypoints.metrics import Metrics, metrics_label

        self.engine = engine
        self.index = index
        # Set once serve() runs its loop: front ends connecting before wait for it.
        self._serving = threading.Event()
        self._peer_numbers = itertools.count()
        self.metrics = Metrics(
            metrics_label(engine.config.model_config.served_model_name[0]),
            engine.engine.max_model_len,
        )
        engine.step_listeners.append(self.metrics.on_step)
        engine.abort_listeners.append(self.metrics.on_aborted)
        self.peers: list[_Peer] = []
        # Unfinished request ids of each running group: the load is their total.
        self._live: dict[tuple[_Peer, int], set[str]] = {}
        self._flush_scheduled = False
        self._exit_code = 0

    async def serve(self, status: Connection) -> int:
        self.loop = asyncio.get_running_loop()
        self.stopping = asyncio.Event()
        for target, args in ((self._watch_parent, (status,)), (self._watch_engine, ())):
            threading.Thread(target=target, args=args, daemon=True).start()
        self._serving.set()
        await self.stopping.wait()
        for peer in self.peers:
            for task in peer.groups.values():
                task.cancel()
        await asyncio.sleep(0)
        return self._exit_code

    # ------------------------------------------------------------- threads

    def connected(self, conn: Connection) -> None:
        """A front end's connection (its key checked), on its own thread: read it."""
        self._serving.wait()
        peer = _Peer(conn)
        self.loop.call_soon_threadsafe(self.peers.append, peer)
        threading.current_thread().name = f"pagedllm-replica-peer-{next(self._peer_numbers)}"
        self._read(peer)

    def _read(self, peer: _Peer) -> None:
        while True:
            try:
                message = pickle.loads(peer.conn.recv_bytes())
            except (EOFError, OSError):
                self.loop.call_soon_threadsafe(self._drop, peer)
                return
            self.loop.call_soon_threadsafe(self._handle, peer, message)

    def _watch_parent(self, status: Connection) -> None:
        try:
            status.recv()  # ("stop",)
        except (EOFError, OSError):
            logger.warning("the server process is gone; stopping")
        self.loop.call_soon_threadsafe(self.stopping.set)

    def _watch_engine(self) -> None:
        self.engine.dead.wait()

        def die() -> None:
            logger.critical("the engine loop died; this replica exits")
            self._exit_code = 1
            self.stopping.set()

        self.loop.call_soon_threadsafe(die)

    # ------------------------------------------------------------ the loop

    def _handle(self, peer: _Peer, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "add":
            _, group, requests = message
            peer.acked += len(requests)
            self._live[(peer, group)] = {r.request_id for r in requests}
            task = self.loop.create_task(self._run(peer, group, requests))
            peer.groups[group] = task
            # (Also when the group is cancelled before its task ever ran.)
            task.add_done_callback(lambda _: self._group_done(peer, group))
            self._schedule_flush()
        elif kind == "abort":
            task = peer.groups.pop(message[1], None)
            if task is not None:
                task.cancel()
        elif kind == "call":
            _, call_id, op, argument = message
            self.loop.create_task(self._call(peer, call_id, op, argument))

    async def _run(self, peer: _Peer, group: int, requests: list[Any]) -> None:
        unfinished = self._live[(peer, group)]
        prompted: set[str] = set()
        try:
            async for index, output in self.engine.generate_many(requests):
                if output.finished:
                    unfinished.discard(output.request_id)
                if output.request_id in prompted:
                    # (The prompt went with the request's first output; the front end
                    # puts it back: not pickled again for every streamed token.)
                    output = dataclasses.replace(
                        output, prompt=None, prompt_token_ids=[], prompt_logprobs=None
                    )
                prompted.add(output.request_id)
                self._send(peer, ("out", group, index, output))
        except asyncio.CancelledError:
            pass  # (the front end aborted it; generate_many aborted the requests)
        except Exception as exc:
            self._send(peer, ("fail", group, *wire_error(exc)))

    def _group_done(self, peer: _Peer, group: int) -> None:
        """A group's requests no longer count in the load (finished, failed, aborted)."""
        self._live.pop((peer, group), None)
        peer.groups.pop(group, None)
        self._schedule_flush()

    async def _call(self, peer: _Peer, call_id: int, op: str, argument: Any) -> None:
        try:
            value: Any = None  # (not the loaded adapter: its weights stay here)
            if op == "load_lora":
                await asyncio.wrap_future(self.engine.load_lora(argument))
            elif op == "unload_lora":
                await asyncio.wrap_future(self.engine.unload_lora(argument))
            elif op == "metrics":
                self.metrics.refresh(self.engine.engine)
                value = list(self.metrics.registry.collect())
            elif op == "stop_compiling":
                self.engine.stop_compiling()
            else:
                raise ValueError(f"unknown replica call {op!r}")
        except Exception as exc:
            self._send(peer, ("reply", call_id, False, wire_error(exc)))
        else:
            self._send(peer, ("reply", call_id, True, value))

    def _drop(self, peer: _Peer) -> None:
        """A front end went away: its requests are aborted (their tasks cancelled)."""
        if peer in self.peers:
            self.peers.remove(peer)
        for task in list(peer.groups.values()):
            task.cancel()
        peer.conn.close()

    def _send(self, peer: _Peer, event: tuple[Any, ...]) -> None:
        peer.outbox.append(event)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """One message to each front end with events for it or an outdated load."""
        self._flush_scheduled = False
        load = sum(len(ids) for ids in self._live.values())
        for peer in list(self.peers):
            if not peer.outbox and peer.sent_load == load and peer.sent_acked == peer.acked:
                continue
            events, peer.outbox = peer.outbox, []
            try:
                data = pickle.dumps((load, peer.acked, events), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # (an output that does not pickle fails its group)
                logger.exception("an output could not be sent")
                error = wire_error(RequestFailedError(f"the output could not be sent: {exc}"))
                groups = {event[1] for event in events if event[0] in ("out", "fail")}
                for group in groups:
                    task = peer.groups.pop(group, None)
                    if task is not None:
                        task.cancel()
                events = [("fail", group, *error) for group in groups]
                data = pickle.dumps((load, peer.acked, events))
            try:
                peer.conn.send_bytes(data)
            except OSError:
                self._drop(peer)
                continue
            peer.sent_load, peer.sent_acked = load, peer.acked
