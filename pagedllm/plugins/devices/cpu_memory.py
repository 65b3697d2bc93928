"""Sleep mode on the cpu device: a storage's memory goes back to the system with
``madvise(MADV_DONTNEED)`` on the whole pages inside it, so that its address stays valid
(the native kernels keep raw pointers); its next touch maps zeroed pages. Only storages in
anonymous writable mappings are released (a file-backed or read-only one, such as a
memory-mapped checkpoint, is left as it is)."""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
from typing import Any, BinaryIO

_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


def _anonymous_writable() -> list[tuple[int, int]]:
    """The (start, end) of this process's anonymous writable mappings, sorted, adjacent
    ones merged."""
    spans: list[tuple[int, int]] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            perms, inode = fields[1], fields[4]
            path = fields[5].strip() if len(fields) > 5 else ""
            anonymous = not path or path == "[heap]" or path.startswith("[anon")
            if perms[1] != "w" or inode != "0" or not anonymous:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if spans and spans[-1][1] == start:
                spans[-1] = (spans[-1][0], end)
            else:
                spans.append((start, end))
    return spans


def _releasable(spans: list[tuple[int, int]], ptr: int, nbytes: int) -> tuple[int, int] | None:
    """The page-aligned (start, length) inside [ptr, ptr + nbytes), if in one span."""
    start = -(-ptr // _PAGE) * _PAGE
    end = (ptr + nbytes) // _PAGE * _PAGE
    if end <= start:
        return None
    i = bisect.bisect_right(spans, (ptr, float("inf"))) - 1
    if i < 0 or not spans[i][0] <= ptr or ptr + nbytes > spans[i][1]:
        return None
    return start, end - start


def _madvise() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def _view(ptr: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")


def release(storages: list[Any], save: BinaryIO | None) -> int:
    """:meth:`Device.release_memory` on the cpu: every releasable storage's bytes written
    to ``save`` (no copy), and only then (a failed write releases nothing) their whole
    pages dropped. The bytes dropped."""
    spans = _anonymous_writable()
    chosen = []
    for storage in storages:
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        pages = _releasable(spans, ptr, nbytes)
        if pages is not None:
            chosen.append(pages)
            if save is not None:
                save.write(_view(ptr, nbytes))
    if save is not None:
        save.flush()
    madvise = _madvise()
    for start, length in chosen:
        if madvise(start, length, _MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_DONTNEED): {os.strerror(err)}")
    return sum(length for _, length in chosen)


def restore(storages: list[Any], source: BinaryIO | None) -> None:
    """:meth:`Device.restore_memory` on the cpu: the pages come back on their next touch;
    with ``source``, the bytes of the storages :func:`release` wrote are read back into
    them (the same storages, in the same order, so the same ones are releasable)."""
    if source is None:
        return
    spans = _anonymous_writable()
    for storage in storages:
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if _releasable(spans, ptr, nbytes) is None:
            continue
        view, done = _view(ptr, nbytes), 0
        while done < nbytes:
            got = source.readinto(view[done:])
            if not got:
                raise OSError(f"sleep mode: the weights' file ended {nbytes - done} bytes early")
            done += got
