"""A response's JSON body written off the event loop, and its memory given back.

json's C encoder holds the GIL for a whole call (a 57 MB body: seconds), so a worker
thread alone would not free the event loop: a large body is written in pieces, each one
call, with the loop's thread taking its turns between them. Once a large body is sent,
the heap it freed goes back to the OS.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import json
from typing import Any

from fastapi.responses import Response

# A body at least this large gives the heap it freed back to the OS once sent.
TRIM_AFTER_BYTES = 8 << 20

_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode
# A large body is written in pieces of about this many JSON values.
_PIECE_VALUES = 4096


def dumps(content: Any) -> bytes:
    """``content`` as the server's JSON body (as FastAPI's ``JSONResponse`` writes it),
    written in pieces."""
    pieces: list[str] = []
    _write(content, pieces)
    return "".join(pieces).encode("utf-8")


def _values_within(obj: Any, budget: int) -> int | None:
    """How many JSON values ``obj`` is made of, or None if more than ``budget``."""
    count, stack = 0, [obj]
    while stack:
        value = stack.pop()
        count += 1
        if count > budget:
            return None
        if isinstance(value, dict):
            stack.extend(itertools.islice(value.values(), budget))
        elif isinstance(value, (list, tuple)):
            stack.extend(value[:budget])
    return count


def _write(obj: Any, pieces: list[str]) -> None:
    if _values_within(obj, _PIECE_VALUES) is not None:
        pieces.append(_encode(obj))
    elif isinstance(obj, dict):
        if not all(isinstance(key, str) for key in obj):
            pieces.append(_encode(obj))  # (json's own key conversions)
            return
        pieces.append("{")
        for i, (key, value) in enumerate(obj.items()):
            pieces.append(f"{',' if i else ''}{_encode(key)}:")
            _write(value, pieces)
        pieces.append("}")
    else:  # a list (or tuple) of many values
        each = _values_within(obj[0], _PIECE_VALUES) if obj else None
        pieces.append("[")
        if each is None:
            for i, value in enumerate(obj):
                if i:
                    pieces.append(",")
                _write(value, pieces)
        else:  # (its values alike: a few at a time, each slice written whole)
            step = max(_PIECE_VALUES // each, 1)
            for start in range(0, len(obj), step):
                if start:
                    pieces.append(",")
                pieces.append(_encode(obj[start : start + step])[1:-1])
        pieces.append("]")


class JSONBody(Response):
    """A serialized JSON body that, once sent, lets its memory go (and a large one
    hands the heap it freed back to the OS)."""

    media_type = "application/json"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            large = len(self.body) >= TRIM_AFTER_BYTES
            self.body = b""
            if large:
                await asyncio.to_thread(release_memory)


def release_memory_soon() -> None:
    """:func:`release_memory` once a refused response's objects are gone (they go as
    the 400 unwinds the handler, which holds them until then)."""
    loop = asyncio.get_running_loop()
    loop.call_later(1.0, lambda: loop.run_in_executor(None, release_memory))


def release_memory() -> None:
    """Give the heap's free memory back to the OS (glibc; elsewhere nothing). The CPU
    device keeps up to 1 GiB of freed heap for its next step's buffers
    (``PAGEDLLM_CPU_MALLOC_TUNING``); a large response's memory is not worth keeping."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
