"""Tensor-parallel and pipeline-parallel worker processes (``--distributed-executor-backend
mp``; ``ray`` runs the same ranks as Ray actors, :mod:`pagedllm.distributed.ray_executor`).

The engine's process is rank 0: it schedules, computes its shard of every step (or, with
pipeline parallelism, the first stage: see :mod:`pagedllm.distributed.pipeline`) and
samples. Ranks 1 to N - 1 are processes started here (new interpreters that do not run
the user's script, by default: :mod:`pagedllm.distributed.worker_start`), each joining the
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
from pagedllm.distributed.parallel_state import destroy_distributed, init_distributed
from pagedllm.distributed.worker_start import LoadGate, RankStarter

logger = logging.getLogger(__name__)

# How long rank 0 waits for a worker to build its shard of the model.
LOAD_TIMEOUT_S = 600.0


def collective_backend(device_name: str) -> str:
    """The ``torch.distributed`` backend for a device: NCCL between GPUs, gloo else."""
    return "nccl" if device_name == "cuda" else "gloo"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _send(conn: Connection, message: tuple[Any, ...]) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def rank_name(config: Any, rank: int) -> str:
    """How errors name worker ``rank``: a tensor-parallel rank, a pipeline stage, or a
    tensor-parallel rank of a stage."""
    parallel = config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if pp == 1:
        return f"tensor-parallel worker rank {rank}"
    if tp == 1:
        return f"pipeline stage {rank}"
    return f"pipeline stage {rank // tp} (its tensor-parallel rank {rank % tp})"


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


def _kind(config: Any) -> str:
    parallel = config.parallel_config
    return "tensor-parallel" if parallel.pipeline_parallel_size == 1 else "pipeline-parallel"


def world_size(config: Any) -> int:
    """The engine's ranks: its tensor-parallel ranks or its pipeline stages."""
    parallel = config.parallel_config
    return parallel.tensor_parallel_size * parallel.pipeline_parallel_size


def start_workers(config: Any) -> Any:
    """Start the workers (processes, or Ray actors with ``--distributed-executor-backend
    ray``) and join their group as rank 0 (before the model is built)."""
    parallel = config.parallel_config
    size = world_size(config)
    pipeline = parallel.pipeline_parallel_size > 1
    device = config.device_config.device
    if torch.distributed.is_initialized():
        raise ConfigError(
            "this process already belongs to a tensor-parallel or pipeline group (another "
            "engine's): "
            "shut that engine down first (LLM(...).llm_engine.shutdown())"
        )
    if parallel.distributed_executor_backend == "ray":
        from pagedllm.distributed.ray_executor import RayWorkerGroup

        group: Any = RayWorkerGroup(config, size)
    else:
        group = WorkerGroup(config, size)
    try:
        _join_watching(group, parallel, collective_backend(device.name))
    except BaseException:
        group.shutdown()
        raise
    logger.info(
        "%s parallelism: %d ranks (%s, %s), rank 0 in this process",
        "pipeline" if pipeline else "tensor",
        size,
        collective_backend(device.name),
        group.init_method,
    )
    return group


def _join_watching(group: Any, parallel: Any, backend: str) -> None:
    """Join the group as rank 0 while watching the workers: one that dies before it
    joins (a failed import, a GPU it cannot use) ends the wait at once."""
    errors: list[BaseException] = []

    def join() -> None:
        try:
            init_distributed(
                0,
                parallel.tensor_parallel_size,
                group.init_method,
                backend,
                stages=parallel.pipeline_parallel_size,
                experts=parallel.enable_expert_parallel,
            )
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=join, name="pagedllm-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.2)
        if thread.is_alive() and isinstance(group, WorkerGroup):
            group._raise_if_dead()
    if errors:
        raise errors[0]


@dataclasses.dataclass(frozen=True, slots=True)
class RankLoaded:
    """What a rank above 0 reports once built: the (input, output) sizes of the layers an
    adapter may target (None without --enable-lora), which rank 0 checks adapters
    against (a pipeline stage holds layers it does not), and when it loaded its weights
    (wall-clock start and end)."""

    lora_layers: dict[str, tuple[int, int]] | None
    loading: tuple[float, float]


@contextlib.contextmanager
def loading_turn(gate: Any) -> Iterator[list[float]]:
    """Within: this rank loads its weights, once ``gate`` (a semaphore shared by the
    ranks, --max-parallel-loading-workers; None: no limit) lets it; yields the
    ``[start, end]`` wall-clock times, filled on the way out."""
    times: list[float] = []
    with gate if gate is not None else contextlib.nullcontext():
        times.append(time.time())
        try:
            yield times
        finally:
            times.append(time.time())


class WorkerRank:
    """One rank above 0 (a tensor-parallel rank or a pipeline stage), as the ``mp`` worker
    processes and the Ray actors both run it: :meth:`load` joins the group and builds this
    rank's shard (or stage), :meth:`profile` takes part in rank 0's profiled step,
    :meth:`cache` allocates its KV cache and :meth:`follow` computes its part of each
    step. ``cores``: the CPUs the ranks on this machine share (by default the device's
    thread count)."""

    def __init__(
        self,
        config: Any,
        rank: int,
        size: int,
        init_method: str,
        cores: int | None = None,
        load_gate: Any = None,
    ) -> None:
        self.config, self.rank, self.size, self.init_method = config, rank, size, init_method
        self.cores = cores
        # (--max-parallel-loading-workers: a semaphore the loading ranks share)
        self.load_gate = load_gate
        self.loaded: Any = None
        self.backend: Any = None
        self.runner: Any = None
        self.lora: Any = None  # (with --enable-lora: the adapters rank 0 runs each step)

    def load(self) -> tuple[str, Any]:
        """Join the group and build this rank's part: ``("loaded", facts)``, the facts a
        :class:`RankLoaded`."""
        from pagedllm.core.args.validate import attention_backend_name
        from pagedllm.core.compilation import compile_model
        from pagedllm.core.model_setup import load_model
        from pagedllm.core.plugins import make_plugin_manager

        config = self.config
        device = config.device_config.device
        if device.name == "cuda":
            torch.cuda.set_device(self.rank)
        parallel = config.parallel_config
        self.pipeline = parallel.pipeline_parallel_size > 1
        init_distributed(
            self.rank,
            parallel.tensor_parallel_size,
            self.init_method,
            collective_backend(device.name),
            stages=parallel.pipeline_parallel_size,
            experts=parallel.enable_expert_parallel,
        )
        pm = make_plugin_manager()
        with loading_turn(self.load_gate) as loading:
            self.loaded = load_model(config, pm)
        compile_model(self.loaded.model, config.compilation_config.level)
        if config.lora_config is not None:  # (its slots before the KV cache, as rank 0's)
            from pagedllm.lora.manager import make_lora_manager

            loaded, torch_device = self.loaded, config.device_config.torch_device
            self.lora = make_lora_manager(
                loaded.model, config.lora_config, loaded.dtype, torch_device
            )
        cores = device.num_threads() if self.cores is None else self.cores
        torch.set_num_threads(max(1, cores // self.size))
        self.backend = pm.load("attention_backends", attention_backend_name(device, pm))()
        lora_layers = None if self.lora is None else dict(self.lora.sizes)
        return "loaded", RankLoaded(lora_layers, (loading[0], loading[1]))

    def profile(self, payload: dict[str, Any]) -> None:
        """``payload``: :func:`~pagedllm.core.runner.profile_step`'s arguments but the
        model, the backend and the device."""
        from pagedllm.core.runner import profile_step
        from pagedllm.distributed.parallel_state import pipeline_parallel

        if pipeline_parallel().rank > 0:
            return  # (rank 0 profiles stage 0 with its tensor-parallel ranks alone)
        device = self.config.device_config.torch_device
        profile_step(self.loaded.model, self.backend, device=device, **payload)

    def cache(self, payload: tuple[Any, ...]) -> str:
        from pagedllm.core.runner import ModelRunner, set_kv_scales

        spec, num_blocks, block_size, vocab_size = payload
        if self.pipeline:  # (rank 0's spec holds stage 0's layers)
            from pagedllm.distributed.parallel_state import stage_layers

            spec = dataclasses.replace(spec, layers=stage_layers(spec.num_layers))
        set_kv_scales(self.loaded.model, self.config.cache_config, spec.dtype)
        self.runner = ModelRunner(
            self.loaded.model, spec, num_blocks, block_size, vocab_size,
            self.config.device_config.torch_device, self.backend,
        )  # fmt: skip
        self.runner.sampler = None  # (rank 0 samples)
        self.runner.lora = self.lora
        if self.pipeline:
            self.runner.set_stage_io(self.loaded)
        return "ready"

    def follow(self, step: Any) -> None:
        self.runner.follow(step)

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

    def stop(self) -> None:
        destroy_distributed()


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
