"""A rank above 0 as a new interpreter (the ``mp`` backend's default way to start one:
:mod:`pagedllm.distributed.worker_start`), which never runs the user's script.

Started with the file descriptor of its end of a pipe on its command line; the first
messages are the parent's ``sys.path`` (so that plugins and the model's modules import
as they do there), the engine's pickled configuration, and the rest of
:func:`~pagedllm.distributed.executor.worker_main`'s arguments. Only the standard
library is imported before ``sys.path`` is set.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from multiprocessing.connection import Connection


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    try:
        sys.path[:] = pickle.loads(conn.recv_bytes())
        config = pickle.loads(conn.recv_bytes())
        args = pickle.loads(conn.recv_bytes())
        from pagedllm.distributed.executor import worker_main
    except EOFError:  # rank 0 is gone
        return
    except BaseException as exc:  # (told to rank 0, which raises it)
        message = f"{exc!r}\n{traceback.format_exc()}"
        conn.send_bytes(pickle.dumps(("error", message)))
        raise SystemExit(1) from None
    worker_main(config, *args, conn)
