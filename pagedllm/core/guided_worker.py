"""The process that compiles guided-decoding constraints (``python -m`` this module).

It is started by :class:`pagedllm.core.guided_compile.CompilePool` with two pipe file
descriptors on its command line. Messages are pickled over them: first the tokenizer and
the parent's ``sys.path`` (so that a plugin's backend class imports here too), then one
job at a time. For each job it answers ``("started",)`` once the backend is ready (the
parent's time limit starts then) and ``("ok", data)`` or ``("error", message)``. It has
no other state than its backends, so the parent can kill it at any moment.
"""

from __future__ import annotations

import pickle
import sys
from multiprocessing.connection import Connection
from typing import Any


def serve(receive: Connection, send: Connection) -> None:
    init = receive.recv()
    sys.path[:] = init["sys_path"]
    tokenizer = pickle.loads(init["tokenizer"])
    vocab_size, eos_token_ids = init["vocab_size"], init["eos_token_ids"]
    backends: dict[Any, Any] = {}
    send.send(("ready",))
    while True:
        try:
            job = receive.recv_bytes()
        except EOFError:  # the parent is gone
            return
        try:
            backend_cls, constraint, options = pickle.loads(job)
            backend = backends.get(backend_cls)
            if backend is None:
                backend = backends[backend_cls] = backend_cls(tokenizer, vocab_size, eos_token_ids)
                backend.warm_up()
            send.send(("started",))
            compiled = backend.compile(constraint, options)
            send.send(("ok", backend.dump_compiled(compiled)))
        except ValueError as exc:
            send.send(("error", str(exc)))
        except MemoryError:
            send.send(("memory", "ran out of memory"))
        except Exception as exc:  # a backend's bug: the request gets it as a 400
            send.send(("error", f"{type(exc).__name__}: {exc}"))


def main() -> None:
    receive = Connection(int(sys.argv[1]), writable=False)
    send = Connection(int(sys.argv[2]), readable=False)
    try:
        serve(receive, send)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass


if __name__ == "__main__":
    main()
