"""A fast GGUF (v2/v3) header reader: metadata and tensor index, tensors memory-mapped.

``gguf.GGUFReader`` decodes every metadata array (a 49k-token vocabulary, its merges)
into numpy views and takes seconds; this walk skips the big arrays, keeping only their
length, and reads tensor data lazily from a memory map.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import struct
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from pagedllm.core.errors import ConfigError

# GGUF metadata value types -> struct format (8: string and 9: array are variable).
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayInfo:
    """A metadata array that was skipped, not decoded: its element type and length."""

    element_type: int
    length: int

    def __len__(self) -> int:
        return self.length


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]  # GGUF order: ne[0] is the innermost dimension
    qtype: int
    offset: int  # absolute byte offset in the file

    @property
    def shape(self) -> tuple[int, ...]:
        """The torch shape (``ne`` reversed)."""
        return tuple(reversed(self.ne))


class _Cursor:
    """Reads metadata values from a header's bytes, advancing ``pos``.

    (A class, not closures over the parse: a recursive closure is a reference cycle,
    which kept the GGUFFile and its memory map of the whole file alive until a cyclic
    collection, and never where the server freezes its start-up objects.)"""

    __slots__ = ("head", "max_decoded_array", "path", "pos")

    def __init__(self, head: bytes, pos: int, path: Path, max_decoded_array: int) -> None:
        self.head = head
        self.pos = pos
        self.path = path
        self.max_decoded_array = max_decoded_array

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.head, self.pos)
        self.pos += 8 + n
        if self.pos > len(self.head):
            raise struct.error("past the end")
        return self.head[self.pos - n : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        head = self.head
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", head, self.pos)
            self.pos += 12
            if count <= self.max_decoded_array:
                return [self.value(etype) for _ in range(count)]
            if etype in _SCALARS:
                self.pos += struct.calcsize(_SCALARS[etype]) * count
            elif etype == _STRING:  # skipped, not decoded (the vocabulary: 0.2 s)
                length = _U64.unpack_from
                pos = self.pos
                for _ in range(count):
                    pos += 8 + length(head, pos)[0]
                self.pos = pos
            else:
                for _ in range(count):
                    self.value(etype)
            if self.pos > len(head):
                raise struct.error("past the end")
            return ArrayInfo(etype, count)
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise ConfigError(f"{self.path}: unknown GGUF metadata type {vtype}")
        (v,) = struct.unpack_from(fmt, head, self.pos)
        self.pos += struct.calcsize(fmt)
        return v


class GGUFFile:
    """Metadata (scalars and strings decoded, arrays as :class:`ArrayInfo` unless they
    are short) and the tensor index of one GGUF file."""

    # Arrays up to this many elements are decoded into lists.
    max_decoded_array = 64

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    def _parse(self) -> None:
        with self.path.open("rb") as f:
            size = 1 << 22
            while True:
                f.seek(0)
                head = f.read(size)
                try:
                    self._parse_header(head)
                    return
                except struct.error:
                    if len(head) < size:  # the whole file was read: it is truncated
                        raise ConfigError(f"{self.path}: truncated GGUF header") from None
                    size *= 4

    def _parse_header(self, head: bytes) -> None:
        if head[:4] != b"GGUF":
            raise ConfigError(f"{self.path} is not a GGUF file (bad magic {head[:4]!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version not in (2, 3):
            raise ConfigError(f"{self.path}: GGUF version {version} is not supported (2, 3)")
        cursor = _Cursor(head, 24, self.path, self.max_decoded_array)
        string, value = cursor.string, cursor.value
        metadata = {}
        for _ in range(n_kv):
            key = string()
            (vtype,) = struct.unpack_from("<I", head, cursor.pos)
            cursor.pos += 4
            metadata[key] = value(vtype)
        alignment = int(metadata.get("general.alignment", 32))
        infos = []
        for _ in range(n_tensors):
            name = string()
            pos = cursor.pos
            (n_dims,) = struct.unpack_from("<I", head, pos)
            ne = struct.unpack_from(f"<{n_dims}Q", head, pos + 4)
            qtype, offset = struct.unpack_from("<IQ", head, pos + 4 + 8 * n_dims)
            cursor.pos = pos + 4 + 8 * n_dims + 12
            infos.append((name, ne, qtype, offset))
        data_start = (cursor.pos + alignment - 1) // alignment * alignment
        self.metadata = metadata
        self.tensors = {
            name: TensorInfo(name, tuple(int(n) for n in ne), qtype, data_start + offset)
            for name, ne, qtype, offset in infos
        }

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "(none)"))

    @cached_property
    def _mmap(self) -> np.memmap:
        return np.memmap(self.path, dtype=np.uint8, mode="c")  # writable views, file untouched

    def raw(self, name: str) -> np.ndarray:
        """The packed bytes of tensor ``name`` (a read-only view of the memory map),
        shaped ``(*torch_shape[:-1], bytes_per_row)``."""
        from pagedllm.kernels.gguf_dequant import bytes_per_row

        info = self.tensors[name]
        shape = info.shape
        row = bytes_per_row(info.qtype, shape[-1])
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        data = self._mmap[info.offset : info.offset + rows * row]
        return data.reshape(*shape[:-1], row)

    def dequantized(self, name: str, dtype: Any = None) -> Any:
        """Tensor ``name`` as a float torch tensor of its torch shape."""
        import torch

        from pagedllm.kernels.gguf_dequant import dequantize

        info = self.tensors[name]
        raw = torch.from_numpy(np.array(self.raw(name)))
        return dequantize(raw, info.qtype, info.shape, dtype=dtype or torch.float32)


def find_gguf_file(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the path itself if it is a ``.gguf`` file, or the
    only ``.gguf`` in a directory; ``None`` when ``path`` holds no GGUF file. A directory
    with several is an error."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ConfigError(
                f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
                f"pass the path of one"
            )
        return files[0] if files else None
    return None


def installed_file(distribution: str, name: str) -> Path:
    """A file shipped by an installed distribution (its package need not import), or a
    nonexistent path when the distribution or the file is absent."""
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return Path("/nonexistent") / name
    for file in files:
        if file.name == name:
            return Path(file.locate())
    return Path("/nonexistent") / name
