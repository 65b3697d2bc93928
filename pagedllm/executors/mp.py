"""Tensor-parallel and pipeline-parallel worker processes (``--distributed-executor-backend
mp``, :class:`MultiprocExecutor`; ``ray`` runs the same ranks as Ray actors,
:mod:`pagedllm.executors.ray`).

The engine's process is rank 0: it schedules, computes its shard of every step (or, with
pipeline parallelism, the first stage: see :mod:`pagedllm.executors.pipeline`) and
samples. Ranks 1 to N - 1 are processes started here (new interpreters that do not run
the user's script, by default: :mod:`pagedllm.executors.worker_start`), each joining the
``torch.distributed`` group, building its shard of the model and then following rank 0:
every step rank 0 sends them the step's :class:`~pagedllm.core.runner.StepInput` through a
pipe (one pickled message per step, no per-layer calls) and they compute the same
forward pass, the collectives carrying the partial results between the ranks.

A worker that dies (or fails) makes the engine fail loudly: rank 0 checks the workers
before each step and turns a failed collective into :class:`EngineDeadError`, which stops
the engine (a server answers 503 on ``/health`` and exits) rather than hanging.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pickle
import socket
import threading
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

from pagedllm.core.errors import ConfigError, EngineDeadError
from pagedllm.executors.base import check_parallel_support
from pagedllm.executors.uni import UniProcExecutor
from pagedllm.executors.worker import Worker, collective_backend, rank_name
from pagedllm.executors.worker_start import LoadGate, RankStarter

logger = logging.getLogger(__name__)

# How long rank 0 waits for a worker to build its shard of the model.
LOAD_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _send(conn: Connection, message: tuple[Any, ...]) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


class WorkerGroup:
    """Ranks 1 to ``size - 1`` of a tensor- or pipeline-parallel engine, as processes."""

    def __init__(self, config: Any, size: int) -> None:
        self.size = size
        self.config = config
        self.init_method = f"tcp://127.0.0.1:{_free_port()}"
        # (Refuses at once a script that each worker would run again.)
        starter = RankStarter(config, _kind(config))
        # --max-parallel-loading-workers: how many ranks (rank 0 too) load at once.
        limit = config.parallel_config.max_parallel_loading_workers
        self.load_gate = LoadGate(limit) if limit else None
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self._closed = False
        try:
            for rank in range(1, size):
                args = (rank, size, self.init_method, self.load_gate)
                conn, proc = starter.start(rank, args, worker_main, list(self.conns))
                self.conns.append(conn)
                self.procs.append(proc)
        except BaseException:
            self.shutdown()
            raise

    def wait(self, what: str, timeout: float = LOAD_TIMEOUT_S) -> list[Any]:
        """Wait for every worker to report ``what`` (``loaded``, ``ready``); what each
        said with it, by rank."""
        deadline = time.monotonic() + timeout
        details = []
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll(0.2):
                self._raise_if_dead()
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"{rank_name(self.config, rank)}: no {what!r} in time")
            kind, detail = pickle.loads(conn.recv_bytes())
            if kind == "error":
                raise ConfigError(f"{rank_name(self.config, rank)} failed: {detail}")
            if kind != what:
                raise EngineDeadError(f"{rank_name(self.config, rank)} sent {kind!r}")
            details.append(detail)
        return details

    def send(self, kind: str, payload: Any = None) -> None:
        """One message to every worker (pickled once)."""
        self._raise_if_dead()
        data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            raise EngineDeadError(f"a worker process is gone: {exc}") from exc

    def step(self, step: Any) -> None:
        self.send("follow", step)

    def _raise_if_dead(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                detail = self._last_error(rank)
                raise EngineDeadError(
                    f"{rank_name(self.config, rank)} exited (code {proc.exitcode})"
                    + (f": {detail}" if detail else "")
                )

    def _last_error(self, rank: int) -> str | None:
        conn = self.conns[rank - 1]
        try:
            while conn.poll(0):
                kind, detail = pickle.loads(conn.recv_bytes())
                if kind == "error":
                    return detail
        except (EOFError, OSError):
            pass
        return None

    def check(self, exc: BaseException) -> BaseException:
        """The error to raise for ``exc`` from a step: EngineDeadError when a worker has
        died or reported a failure (a collective with a dead peer fails), else ``exc``."""
        deadline = time.monotonic() + 2.0  # (a dying worker exits after its sockets close)
        while True:
            for rank in range(1, self.size):
                detail = self._last_error(rank)
                if detail is not None:
                    return EngineDeadError(f"{rank_name(self.config, rank)} failed: {detail}")
            try:
                self._raise_if_dead()
            except EngineDeadError as dead:
                return dead
            if time.monotonic() > deadline:
                return exc
            time.sleep(0.05)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            try:
                _send(conn, ("stop", None))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        if self.load_gate is not None:
            self.load_gate.remove()


@dataclasses.dataclass(slots=True)
class _StepInFlight:
    """A step :meth:`MultiprocExecutor._begin` began: its input and rank 0's plan of it,
    its hidden states (with pipeline stages, the transfers that bring them), its token
    mask, and when it and its forward pass started (timed steps)."""

    step: Any
    plan: Any
    pending: Any
    mask: Any
    started: float
    forward_started: float


def _kind(config: Any) -> str:
    parallel = config.parallel_config
    return "tensor-parallel" if parallel.pipeline_parallel_size == 1 else "pipeline-parallel"


class MultiprocExecutor(UniProcExecutor):
    """Rank 0 in this process (the :class:`~pagedllm.executors.uni.UniProcExecutor`'s
    worker), ranks 1 to N - 1 started by :meth:`start_group` (here worker processes,
    :class:`WorkerGroup`); with one rank, the uni executor."""

    single_process = False

    def __init__(self, config: Any, pm: Any) -> None:
        super().__init__(config, pm)
        self.group: Any = None
        # Pipeline parallelism: stage 0's driver of the stages (PipelineStages).
        self.pipeline: Any = None
        self.size = self.num_ranks
        if self.size == 1:
            return
        # (A missing model or an architecture that cannot be split is refused before
        # any process starts.)
        check_parallel_support(config, pm)
        if torch.distributed.is_initialized():
            raise ConfigError(
                "this process already belongs to a tensor-parallel or pipeline group (another "
                "engine's): "
                "shut that engine down first (LLM(...).llm_engine.shutdown())"
            )
        self.group = self.start_group()
        self.worker = Worker(
            config,
            0,
            self.size,
            self.group.init_method,
            load_gate=getattr(self.group, "load_gate", None),
            pm=pm,
        )
        try:
            self._join_watching()
        except BaseException:
            self.group.shutdown()
            raise
        backend = collective_backend(config.device_config.device.name)
        logger.info(
            "%s parallelism: %d ranks (%s, %s), rank 0 in this process",
            "pipeline" if config.parallel_config.pipeline_parallel_size > 1 else "tensor",
            self.size,
            backend,
            self.group.init_method,
        )

    @property
    def procs(self) -> list[Any]:
        """The other ranks' processes (or actors)."""
        return [] if self.group is None else self.group.procs

    def start_group(self) -> Any:
        """Start ranks 1 to N - 1 (before any model is built)."""
        return WorkerGroup(self.config, self.size)

    def _join_watching(self) -> None:
        """Join the group as rank 0 while watching the workers: one that dies before it
        joins (a failed import, a GPU it cannot use) ends the wait at once."""
        errors: list[BaseException] = []

        def join() -> None:
            try:
                self.worker.join()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=join, name="pagedllm-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.2)
            if thread.is_alive() and isinstance(self.group, WorkerGroup):
                self.group._raise_if_dead()
        if errors:
            raise errors[0]

    def load_model(self) -> Any:
        if self.group is None:
            return super().load_model()
        loaded = self.worker.load()
        # What the other ranks reported once built (RankLoaded).
        ranks = self.group.wait("loaded")
        self.rank_loading = [loaded.loading] + [r.loading for r in ranks]
        self.lora = self.worker.lora
        if self.lora is not None:
            for rank in ranks:  # (the other pipeline stages' layers too)
                self.lora.sizes.update(rank.lora_layers or {})
        return self.worker.loaded

    def profile(self, spec: Any, **step: Any) -> int:
        payload = dict(spec=spec, **step)
        if self.config.parallel_config.tensor_parallel_size > 1:
            # (their collectives meet this rank's; a later stage runs alone)
            self.group.send("profile", payload)
        return self.worker.profile(payload)

    def init_cache(
        self, spec: Any, num_blocks: int, *, extensions: dict[str, Any], graphs: bool
    ) -> Any:
        if self.group is None:
            return super().init_cache(spec, num_blocks, extensions=extensions, graphs=graphs)
        self.group.send("cache", (spec, num_blocks, extensions))
        runner = super().init_cache(spec, num_blocks, extensions=extensions, graphs=graphs)
        self.group.wait("ready")
        stages = self.config.parallel_config.pipeline_parallel_size
        if stages > 1:
            from pagedllm.executors.pipeline import PipelineStages

            tp = self.config.parallel_config.tensor_parallel_size
            self.pipeline = PipelineStages(stages, self.worker.stage_io, tp)
        return runner

    @property
    def steps_in_flight(self) -> int:
        return 1 if self.pipeline is None else self.pipeline.steps_in_flight

    def submit(self, output: Any, token_mask: Any) -> Any:
        """With pipeline stages: the step built, sent to the other ranks and through stage
        0's layers (one micro-batch); :meth:`collect` waits for its final hidden states
        and samples. Otherwise the step is computed here."""
        if self.pipeline is None:
            return self.execute(output, token_mask)
        return self._begin(output, token_mask, micro_batches=1)

    def collect(self, handle: Any) -> Any:
        if not isinstance(handle, _StepInFlight):
            return handle  # (computed by submit)
        return self._end(handle)

    def execute(self, output: Any, token_mask: Any) -> Any:
        """Rank 0 builds the step and sends it to the other ranks first; every row block's
        logits are computed before any work of rank 0 alone, so the ranks' collectives
        and transfers stay in step. A failure among them stops the engine (the ranks
        could not agree on the next step's collectives any more)."""
        if self.group is None:
            return super().execute(output, token_mask)
        return self._end(self._begin(output, token_mask))

    def _begin(
        self, output: Any, token_mask: Any, micro_batches: int | None = None
    ) -> _StepInFlight:
        """A step built and sent to the other ranks, and this rank's part of its forward
        pass done (with pipeline stages: stage 0's layers on its ``micro_batches``, the
        final hidden states' receives posted)."""
        runner = self.runner
        timed = runner.time_steps
        started = time.perf_counter() if timed else 0.0
        with self._shared_step(), runner.step_mode():
            step, plan = runner.build_step(output)
            message = step
            if self.pipeline is not None:
                message = self.pipeline.split(runner, step, micro_batches)
            self.group.step(message)
            try:
                forward_started = runner.synced_clock() if timed else 0.0
                if self.pipeline is None:
                    pending = runner.hidden_states(step)
                else:
                    pending = self.pipeline.start(runner, message)
            except Exception as exc:
                raise self._stopped(exc) from exc
        return _StepInFlight(step, plan, pending, token_mask, started, forward_started)

    def _end(self, handle: _StepInFlight) -> Any:
        """The results of a step :meth:`_begin` began: its final hidden states (waited
        for, with pipeline stages), every row block's logits, then sampling."""
        runner = self.runner
        with self._shared_step(), runner.step_mode():
            try:
                hidden = handle.pending
                if self.pipeline is not None:
                    hidden = self.pipeline.finish(runner, handle.pending)
                forwarded = runner.synced_clock() if runner.time_steps else 0.0
                computed = [
                    None if rows is None else runner.logits(hidden, rows)
                    for rows in runner.row_blocks(handle.step)
                ]
            except Exception as exc:
                raise self._stopped(exc) from exc
            result = runner.finish(handle.plan, hidden, computed.__getitem__, handle.mask)
        if runner.time_steps:
            # (with steps in flight, the forward time runs to the last stage's return)
            runner.record_times(result, handle.started, forwarded - handle.forward_started)
        return result

    @contextlib.contextmanager
    def _shared_step(self) -> Iterator[None]:
        """Within: a step the other ranks take part in. A collective fails when a worker
        died: that is raised as the worker's EngineDeadError (the engine cannot go on);
        any other failure as it is."""
        try:
            yield
        except EngineDeadError:
            raise
        except Exception as exc:
            dead = self.group.check(exc)
            if isinstance(dead, EngineDeadError):
                raise dead from exc
            raise

    def _stopped(self, exc: Exception) -> EngineDeadError:
        """The error that stops the engine after ``exc`` within a step shared with the
        other ranks: a worker that died names itself; else rank 0 is out of step with
        them (they could not agree on the next step's collectives or transfers)."""
        dead = self.group.check(exc)
        if isinstance(dead, EngineDeadError):
            return dead
        return EngineDeadError(
            f"rank 0 failed within a step, out of step with the other ranks: {exc!r}"
        )

    def save_sharded_state(self, output: Any, pattern: str | None, max_size: int | None) -> None:
        if self.group is None:
            super().save_sharded_state(output, pattern, max_size)
            return
        # (each rank writes its own part, at the same time)
        self.group.send("save_sharded_state", (str(output), pattern, max_size))
        try:
            super().save_sharded_state(output, pattern, max_size)
        finally:
            failures = [f for f in self.group.wait("saved") if f]
        if failures:
            raise ConfigError(f"save_sharded_state: another rank failed: {failures[0]}")

    def sleep(self, level: int) -> None:
        self._on_every_rank("sleep", level)

    def wake_up(self, tags: list[str] | None) -> None:
        self._on_every_rank("wake_up", tags)

    def _on_every_rank(self, method: str, argument: Any) -> None:
        """Rank 0's worker and every other rank's run ``method(argument)`` (at once); the
        first failure is raised once all have answered."""
        if self.group is None:
            getattr(super(), method)(argument)
            return
        self.group.send(method, argument)
        try:
            getattr(self.worker, method)(argument)
        finally:
            failures = [f for f in self.group.wait("done") if f]
        if failures:
            raise RuntimeError(f"{method}: another rank failed: {failures[0]}")

    def shutdown(self) -> None:
        super().shutdown()
        if self.group is not None:
            self.group.shutdown()
            self.worker.leave()


class WorkerRank:
    """A rank above 0 answering rank 0's messages, as the ``mp`` worker processes and the
    Ray actors both run it: ``load`` joins the group and builds this rank's part
    (:class:`~pagedllm.executors.worker.Worker`), ``profile`` takes part in rank 0's
    profiled step, ``cache`` allocates its KV cache and ``follow`` computes its part of
    each step."""

    def __init__(
        self,
        config: Any,
        rank: int,
        size: int,
        init_method: str,
        cores: int | None = None,
        load_gate: Any = None,
    ) -> None:
        self.config, self.rank = config, rank
        self.worker = Worker(config, rank, size, init_method, cores, load_gate)

    def load(self) -> tuple[str, Any]:
        """``("loaded", facts)``, the facts a :class:`~pagedllm.executors.worker.RankLoaded`."""
        self.worker.join()
        return "loaded", self.worker.load()

    def profile(self, payload: dict[str, Any]) -> None:
        self.worker.profile(payload)

    def cache(self, payload: tuple[Any, int, dict[str, Any]]) -> str:
        spec, num_blocks, extensions = payload
        self.worker.init_cache(spec, num_blocks, extensions)
        return "ready"

    def follow(self, step: Any) -> None:
        self.worker.follow(step)

    def save_sharded_state(self, payload: tuple[str, str | None, int | None]) -> tuple[str, Any]:
        """This rank's part of ``LLM.save_sharded_state``: ``("saved", None)``, or with
        the error (rank 0 raises it; this rank goes on serving)."""
        from pathlib import Path

        from pagedllm.core.plugins import make_plugin_manager
        from pagedllm.plugins.loaders.sharded_state import save_rank_state

        output, pattern, max_size = payload
        try:
            save_rank_state(self.config, make_plugin_manager(), Path(output), pattern, max_size)
        except Exception as exc:
            return "saved", f"{rank_name(self.config, self.rank)}: {exc!r}"
        return "saved", None

    def sleep(self, level: int) -> tuple[str, Any]:
        return self._answer(self.worker.sleep, level)

    def wake_up(self, tags: list[str] | None) -> tuple[str, Any]:
        return self._answer(self.worker.wake_up, tags)

    def _answer(self, method: Any, argument: Any) -> tuple[str, Any]:
        """``("done", None)``, or with this rank's error (rank 0 raises it)."""
        try:
            method(argument)
        except Exception as exc:
            return "done", f"{rank_name(self.config, self.rank)}: {exc!r}"
        return "done", None

    def stop(self) -> None:
        self.worker.leave()


def worker_main(
    config: Any,
    rank: int,
    size: int,
    init_method: str,
    load_gate: Any,
    conn: Connection,
    inherited: list[Connection] | tuple[()] = (),
) -> None:
    """A worker process: a :class:`WorkerRank` doing what rank 0's
    messages say (``load`` first, then ``profile``, ``cache``, ``follow``; a method's
    answer goes back) until ``stop`` or until rank 0 is gone. ``inherited``: rank 0's
    pipe ends that a forked worker holds copies of, closed first (else it would not see
    rank 0's end close)."""
    for end in inherited:
        end.close()
    logging.basicConfig(level=logging.WARNING)
    worker = WorkerRank(config, rank, size, init_method, load_gate=load_gate)
    try:
        _send(conn, worker.load())
        while True:
            try:
                kind, payload = pickle.loads(conn.recv_bytes())
            except EOFError:  # rank 0 is gone
                return
            if kind == "stop":
                return
            answer = getattr(worker, kind)(payload)
            if answer is not None:
                _send(conn, answer if isinstance(answer, tuple) else (answer, None))
    except BaseException as exc:  # reported to rank 0, then this process exits
        try:
            _send(conn, ("error", f"{exc!r}\n{traceback.format_exc()}"))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        worker.stop()
