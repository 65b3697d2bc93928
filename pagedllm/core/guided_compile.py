"""Guided-decoding constraints compiled in worker processes, within a time limit and a
memory budget.

Compiling a constraint can take unbounded time and memory (``a{1000000}`` as a regex,
or a JSON schema with deep alternatives), and a thread running native code cannot be
stopped. So each compile runs in a worker process (:mod:`pagedllm.core.guided_worker`)
that is killed when the compile runs past ``timeout`` seconds, grows past ``memory_mib``,
or is no longer wanted (its client went away, or the server is stopping). Up to
``workers`` compiles run at once; a killed worker is replaced on the next compile.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger("pagedllm.guided")

# How long a new worker may take to start, and a backend to get ready in it.
START_TIMEOUT = 120.0
# How often a waiting compile checks its worker's memory and whether it is still wanted.
_TICK = 0.02
_REPLIES = frozenset({"ready", "started", "ok", "error", "memory"})


class CompileLimitError(ValueError):
    """A constraint took too long or too much memory to compile."""


class CompileCancelled(Exception):
    """Nobody waits for this compile any more (or the engine is stopping)."""


@dataclasses.dataclass(slots=True, eq=False)
class _Worker:
    process: subprocess.Popen[bytes]
    send: Connection
    receive: Connection
    # Its memory when it started, and when its current compile started.
    start_rss: int = 0
    baseline_rss: int = 0

    def rss(self) -> int:
        import psutil

        try:
            return psutil.Process(self.process.pid).memory_info().rss
        except psutil.Error:
            return 0

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def close(self) -> None:
        """Kill it and close its pipes (only the thread using it may close them)."""
        self.kill()
        self.send.close()
        self.receive.close()


class CompilePool:
    """Worker processes for :meth:`compile`, started on first use."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        *,
        workers: int,
        timeout: float,
        memory_mib: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.timeout = timeout
        self.memory_bytes = memory_mib * 2**20
        self.memory_mib = memory_mib
        self._slots = threading.BoundedSemaphore(workers)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._lock = threading.Lock()
        self._init_message: dict[str, Any] | None = None
        self._closed = False

    # ------------------------------------------------------------------ compile

    def compile(
        self, backend_cls: type, constraint: Any, options: Any, cancelled: threading.Event
    ) -> bytes:
        """``backend_cls(...).compile(constraint, options)`` in a worker, dumped by the
        backend. Raises ``ValueError`` (the backend's, or :class:`CompileLimitError`),
        or :class:`CompileCancelled` once ``cancelled`` is set."""
        job = pickle.dumps((backend_cls, constraint, options))
        with self._slots:
            worker = self._acquire(cancelled)
            try:
                worker.send.send_bytes(job)
                reply = self._wait(worker, START_TIMEOUT, cancelled, "get ready")
                if reply[0] == "started":
                    # The backend is ready (imported, its vocabulary built): the time
                    # limit and the memory budget count from here.
                    worker.baseline_rss = worker.rss()
                    reply = self._wait(worker, self.timeout, cancelled, "compile")
            except BaseException:
                self._discard(worker)
                raise
            self._release(worker)
        kind, payload = reply
        if kind == "ok":
            return payload
        if kind == "memory":
            raise self._memory_error()
        raise ValueError(payload)

    def _wait(
        self, worker: _Worker, timeout: float, cancelled: threading.Event, doing: str
    ) -> tuple[Any, ...]:
        """The worker's next message; while it compiles, its memory is watched too."""
        deadline = time.monotonic() + timeout
        while True:
            if cancelled.is_set() or self._closed:
                raise CompileCancelled()
            if worker.receive.poll(_TICK):
                try:
                    message = worker.receive.recv()
                except EOFError:
                    message = None
                if not isinstance(message, tuple) or message[0] not in _REPLIES:
                    raise self._died(worker)
                return message
            if worker.process.poll() is not None:
                raise self._died(worker)
            if time.monotonic() > deadline:
                if doing == "compile":
                    raise CompileLimitError(
                        f"compiling it took longer than {self.timeout:g} s "
                        f"(--guided-decoding-compile-timeout)"
                    )
                raise CompileLimitError(f"the guided-decoding worker did not {doing} in time")
            if doing == "compile" and worker.rss() - worker.baseline_rss > self.memory_bytes:
                raise self._memory_error()

    def _memory_error(self) -> CompileLimitError:
        return CompileLimitError(
            f"compiling it needed more than {self.memory_mib} MiB of memory "
            f"(--guided-decoding-compile-memory)"
        )

    def _died(self, worker: _Worker) -> Exception:
        if self._closed:
            return CompileCancelled()
        code = worker.process.poll()
        # A worker that runs out of memory in native code is killed (or aborts).
        return CompileLimitError(
            f"the guided-decoding worker stopped while compiling it (exit code {code}); it "
            f"may have run out of memory"
        )

    # ------------------------------------------------------------------ workers

    def _acquire(self, cancelled: threading.Event) -> _Worker:
        with self._lock:
            if self._closed:
                raise CompileCancelled()
            worker = self._idle.pop() if self._idle else None
        if worker is None or worker.process.poll() is not None:
            worker = self._start(cancelled)
        with self._lock:
            self._busy.add(worker)
        return worker

    def _release(self, worker: _Worker) -> None:
        # A worker that kept what it compiled (past the budget) starts afresh next time.
        grown = worker.rss() - worker.start_rss > self.memory_bytes
        with self._lock:
            self._busy.discard(worker)
            if self._closed or grown:
                worker.close()
            else:
                self._idle.append(worker)

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
        worker.close()

    def _start(self, cancelled: threading.Event) -> _Worker:
        if self._init_message is None:
            self._init_message = {
                "sys_path": list(sys.path),
                "tokenizer": pickle.dumps(self.tokenizer),
                "vocab_size": self.vocab_size,
                "eos_token_ids": tuple(self.eos_token_ids),
            }
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedllm.core.guided_worker",
                str(to_child_r),
                str(from_child_w),
            ],
            pass_fds=(to_child_r, from_child_w),
            stdin=subprocess.DEVNULL,
            # Keep the worker's CPU threads few: it compiles one constraint at a time.
            env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
        )
        os.close(to_child_r)
        os.close(from_child_w)
        worker = _Worker(
            process,
            Connection(to_child_w, readable=False),
            Connection(from_child_r, writable=False),
        )
        try:
            worker.send.send(self._init_message)
            if self._wait(worker, START_TIMEOUT, cancelled, "start")[0] != "ready":
                raise self._died(worker)
        except BaseException:
            worker.close()
            raise
        worker.start_rss = worker.rss()
        logger.debug("guided-decoding worker %d started", process.pid)
        return worker

    def shutdown(self) -> None:
        """Kill every worker; compiles in progress raise :class:`CompileCancelled`."""
        with self._lock:
            self._closed = True
            idle, busy = list(self._idle), list(self._busy)
            self._idle.clear()
        for worker in idle:
            worker.close()
        for worker in busy:  # the thread waiting on it sees it die, and closes it
            worker.kill()
