"""A rank above 0 as a new interpreter (the ``mp`` backend's default way to start one:
:mod:`pagedllm.executors.worker_start`), which never runs the user's script.

Started by standard-library-only code (``worker_start._EXEC_CODE``) that opens the pipe
on the file descriptor named on its command line and sets ``sys.path`` to the parent's
(its first message, so that pagedllm, plugins and the model's modules import as they do
there) before it imports this module; the next messages are the engine's pickled
configuration and the rest of :func:`~pagedllm.executors.mp.worker_main`'s
arguments.
"""

from __future__ import annotations

import pickle
import traceback
from multiprocessing.connection import Connection


def main(conn: Connection) -> None:
    """Run rank's worker; ``sys.path`` is already rank 0's (set by the start-up code)."""
    try:
        config = pickle.loads(conn.recv_bytes())
        args = pickle.loads(conn.recv_bytes())
        from pagedllm.executors.mp import worker_main
    except EOFError:  # rank 0 is gone
        return
    except BaseException as exc:  # (told to rank 0, which raises it)
        message = f"{exc!r}\n{traceback.format_exc()}"
        conn.send_bytes(pickle.dumps(("error", message)))
        raise SystemExit(1) from None
    worker_main(config, *args, conn)
