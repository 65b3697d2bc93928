"""How the ``mp`` backend starts the processes of ranks 1 to N - 1.

By default each is a new interpreter that runs :mod:`pagedllm.executors.worker_process`
(``subprocess``, so fork and exec): it never runs the user's script, so a script that
starts an engine at its top level, without ``if __name__ == "__main__":``, works, and it
inherits nothing from this process, so it is safe whatever this process holds: CUDA
initialised, or threads (a process that has run torch's OpenMP thread pool and forks
gets children that hang in their first parallel operation; GNU OpenMP is not fork-safe).

``PAGEDLLM_WORKER_MULTIPROC_METHOD`` (or vLLM's ``VLLM_WORKER_MULTIPROC_METHOD``) picks
multiprocessing's way instead: ``spawn`` runs the script again in each worker (as
``__mp_main__``), ``fork`` copies this process. ``spawn`` is also what the default turns
to when the engine's configuration refers to something defined in the script (an
``hf_overrides`` function), which only a process that runs the script finds. Either way,
a script that would start another engine in each worker is refused at once, naming the
line and the fix (:mod:`pagedllm.executors.main_guard`), rather than the workers
dying with the cause in their stderr; so is a configuration that refers to objects of a
``__main__`` without a file (``python -c``, a notebook), which no worker can find.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import types
import weakref
from multiprocessing import spawn
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.core.errors import ConfigError, EngineDeadError
from pagedllm.executors.main_guard import unguarded_call_site

logger = logging.getLogger(__name__)

METHOD_VARIABLES = ("PAGEDLLM_WORKER_MULTIPROC_METHOD", "VLLM_WORKER_MULTIPROC_METHOD")
METHODS = ("spawn", "fork")


def chosen_method() -> tuple[str | None, str | None]:
    """The method set in the environment and the variable that set it, or (None, None)."""
    for variable in METHOD_VARIABLES:
        value = os.environ.get(variable, "").strip().lower()
        if value:
            if value not in METHODS:
                raise ConfigError(
                    f"{variable}={value!r}: choose one of {', '.join(METHODS)} (or leave it "
                    "unset: workers then start as new interpreters that do not run the script)"
                )
            return value, variable
    return None, None


class LoadGate:
    """At most ``limit`` processes of this machine inside at once
    (``--max-parallel-loading-workers``): one lock file per place, held with ``flock``,
    which the kernel releases when a holder dies. Picklable, for any way a rank starts."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.directory = tempfile.mkdtemp(prefix="pagedllm-load-")
        self._held: int | None = None
        # (Removed at exit too, when the engine is not shut down; only by its creator.)
        self._remove: Any = weakref.finalize(self, shutil.rmtree, self.directory, True)

    def __getstate__(self) -> tuple[int, str]:
        return self.limit, self.directory

    def __setstate__(self, state: tuple[int, str]) -> None:
        self.limit, self.directory = state
        self._held = None
        self._remove = None

    def __enter__(self) -> LoadGate:
        while True:
            for place in range(self.limit):
                fd = os.open(os.path.join(self.directory, str(place)), os.O_RDWR | os.O_CREAT)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._held = fd
                return self
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        if self._held is not None:
            os.close(self._held)  # (closing releases the lock)
            self._held = None

    def remove(self) -> None:
        if self._remove is not None:
            self._remove()


class WorkerProcess:
    """A rank's new interpreter, with the part of ``multiprocessing.Process`` the group
    uses."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def terminate(self) -> None:
        if self.is_alive():
            self.popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()


class _FindScriptObjects(pickle.Pickler):
    """Pickles, noting the classes and functions defined in the script (``__main__``)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.found: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType) and obj.__module__ == "__main__":
            self.found.append(f"__main__.{obj.__qualname__}")
        return NotImplemented


def _pickle_config(config: Any) -> tuple[bytes, list[str]]:
    buffer = io.BytesIO()
    pickler = _FindScriptObjects(buffer)
    try:
        pickler.dump(config)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"the engine's configuration cannot be sent to its worker processes: {exc} (an "
            "hf_overrides function must be defined at a module's top level, not a lambda)"
        ) from exc
    return buffer.getvalue(), sorted(set(pickler.found))


class RankStarter:
    """Starts ranks 1 to N - 1 of one engine, all the same way (see the module
    docstring); ``what`` names them in errors ("tensor-parallel", "pipeline-parallel")."""

    def __init__(self, config: Any, what: str) -> None:
        import torch

        method, variable = chosen_method()
        if method == "fork" and torch.cuda.is_initialized():
            logger.warning(
                "%s=fork: CUDA is initialised in this process, and a forked process cannot "
                "use it; the workers start as new interpreters instead",
                variable,
            )
            method = None
        self.config_bytes = b""
        reason = f"{variable}=spawn starts the {what} worker processes with multiprocessing's spawn"
        by_script_objects = False  # (why spawn: the variable, or the script's objects)
        if method != "fork":
            config_bytes, objects = _pickle_config(config)
            if objects:
                _refuse_fileless_main(objects)
            if method is None:
                self.config_bytes = config_bytes
                if objects:
                    method, by_script_objects = "spawn", True
                    reason = (
                        f"the engine's configuration refers to {', '.join(objects)}, defined "
                        f"in the script, which only {what} workers started with "
                        "multiprocessing's spawn find"
                    )
        if method == "spawn":
            _refuse_unguarded(reason, by_script_objects)
        self.config = config
        self.what = what
        self.method = method or "exec"
        self.context = multiprocessing.get_context(method) if method else None

    def start(
        self, rank: int, args: tuple[Any, ...], target: Any, inherited: list[Connection]
    ) -> tuple[Connection, Any]:
        """Start rank ``rank``, which runs ``target(config, *args, conn, inherited)``
        (``conn`` its end of the pipe whose other end is returned, with the process).
        ``inherited``: this process's pipe ends so far, which a forked rank closes."""
        if self.context is None:
            return self._start_exec(rank, args)
        parent, child = self.context.Pipe()
        extra = [*inherited, parent] if self.method == "fork" else []
        proc = self.context.Process(
            target=target,
            args=(self.config, *args, child, extra),
            name=f"pagedllm-worker-{rank}",
            daemon=True,
        )
        proc.start()
        child.close()
        return parent, proc

    def _start_exec(self, rank: int, args: tuple[Any, ...]) -> tuple[Connection, Any]:
        parent, child = multiprocessing.Pipe()
        # (The package's own directory first, for this import only: this process may have
        # found pagedllm on a path that neither the environment nor sys.path names.)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        try:
            popen = subprocess.Popen(
                # (multiprocessing's interpreter: set_executable() is respected.)
                [spawn.get_executable(), "-c", _EXEC_CODE, str(child.fileno()), root],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        try:
            parent.send_bytes(pickle.dumps(sys.path))
            parent.send_bytes(self.config_bytes)
            parent.send_bytes(pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as exc:  # (it exited before reading them)
            popen.kill()
            code = popen.wait()
            reason = _reported_error(parent)
            parent.close()
            raise EngineDeadError(
                f"{self.what} worker rank {rank} exited (code {code}) before it received its "
                f"configuration ({exc!r}): " + (reason or "see its output above")
            ) from None
        return parent, WorkerProcess(popen)


# The worker's start-up, standard library only until it has rank 0's sys.path (so that
# pagedllm, its dependencies and plugins import from where they do there).
_EXEC_CODE = """\
import pickle, sys, traceback
from multiprocessing.connection import Connection
conn = Connection(int(sys.argv[1]))
try:
    sys.path[:] = pickle.loads(conn.recv_bytes())
except EOFError:  # rank 0 is gone
    raise SystemExit(0)
try:
    sys.path.insert(0, sys.argv[2])
    from pagedllm.executors.worker_process import main
    sys.path.remove(sys.argv[2])
except BaseException as exc:  # (told to rank 0, which raises it)
    conn.send_bytes(pickle.dumps(("error", f"{exc!r}\\n{traceback.format_exc()}")))
    raise SystemExit(1)
main(conn)
"""


def _reported_error(conn: Connection) -> str | None:
    try:
        while conn.poll(0):
            kind, detail = pickle.loads(conn.recv_bytes())
            if kind == "error":
                return str(detail)
    except (EOFError, OSError, pickle.UnpicklingError):
        pass
    return None


def _refuse_fileless_main(objects: list[str]) -> None:
    """A worker finds the script's objects only by running the script again, which a
    ``python -c`` command, an interactive session or a notebook does not have."""
    if getattr(sys.modules.get("__main__"), "__file__", None) is None:
        names = ", ".join(objects)
        raise ConfigError(
            f"the engine's configuration refers to {names}, defined in __main__, which has "
            "no file (python -c, an interactive session or a notebook), so no worker "
            f"process can find it: define {names.replace('__main__.', '')} in an "
            "importable module and import it from there"
        )


def _refuse_unguarded(reason: str, by_script_objects: bool) -> None:
    site = unguarded_call_site()
    if site is None:
        return
    path, line = site
    fix = (
        "define them in a module that the script imports"
        if by_script_objects
        else "unset the variable (the workers then start without running the script)"
    )
    raise ConfigError(
        f"{reason}: spawn runs the script {path} again in each worker, and its line {line}, "
        f'which starts this engine, is not under `if __name__ == "__main__":`, so each '
        f"worker would start another engine. Put the script's code under "
        f'`if __name__ == "__main__":`, or {fix}.'
    )
