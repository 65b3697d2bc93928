"""The shared-storage KV connector (vLLM's ``ExampleConnector``): each block is a file of
its raw bytes, ``<shared_storage_path>/<key>.kv``, in a folder the engines share.

A file is written aside and renamed into place, so a reader sees a whole block or none;
a file of the wrong size (truncated, or another layout's) is no block. Files are never
deleted by the engines: clear the folder when its prompts are not wanted any more.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces.kv_connector import ConnectorSide, KVBlockLayout, KVConnector

logger = logging.getLogger("pagedllm.kv_transfer")

_EXTRA_KEYS = ("shared_storage_path",)


class SharedStorageConnector(KVConnector):
    name = "ExampleConnector"

    def __init__(self, config: Any, layout: KVBlockLayout, side: ConnectorSide) -> None:
        super().__init__(config, layout, side)
        extra = config.kv_connector_extra_config
        unknown = sorted(set(extra) - set(_EXTRA_KEYS))
        if unknown:
            raise ConfigError(
                f"--kv-transfer-config: kv_connector_extra_config keys {unknown} are not "
                f"{self.name}'s (known: {list(_EXTRA_KEYS)})"
            )
        path = extra.get("shared_storage_path")
        if not path:
            raise ConfigError(
                f"--kv-transfer-config: {self.name} needs kv_connector_extra_config."
                "shared_storage_path, the folder the engines share"
            )
        self.root = Path(path)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if side == "worker":  # (it writes: prove it can, now)
                probe = self.root / f".probe-{uuid.uuid4().hex}"
                probe.write_bytes(b"")
                probe.unlink()
            elif not os.access(self.root, os.R_OK | os.X_OK):
                raise PermissionError(f"cannot read {self.root}")
        except OSError as exc:
            raise ConfigError(
                f"--kv-transfer-config: shared_storage_path {str(self.root)!r} is not a "
                f"{'writable' if side == 'worker' else 'readable'} folder: {exc}"
            ) from None

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.kv"

    def _whole(self, key: str) -> bool:
        try:
            size = self._path(key).stat().st_size
        except OSError:
            return False
        if size != self.layout.nbytes:
            logger.warning(
                "KV transfer: %s has %d bytes, not a block's %d (truncated?); not loaded",
                self._path(key),
                size,
                self.layout.nbytes,
            )
            return False
        return True

    def lookup(self, keys: Sequence[str]) -> int:
        found = 0
        for key in keys:
            if not self._whole(key):
                break
            found += 1
        return found

    def load(self, keys: Sequence[str]) -> list[torch.Tensor]:
        blocks = []
        for key in keys:
            try:
                data = self._path(key).read_bytes()
            except OSError as exc:
                logger.warning("KV transfer: cannot read block %s: %s", key, exc)
                break
            if len(data) != self.layout.nbytes:
                logger.warning(
                    "KV transfer: block file %s has %d bytes, not %d; not loaded",
                    self._path(key),
                    len(data),
                    self.layout.nbytes,
                )
                break
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            blocks.append(raw.view(self.layout.dtype).view(self.layout.shape))
        return blocks

    def save(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> None:
        for key, block in zip(keys, blocks, strict=True):
            path = self._path(key)
            if path.exists() and path.stat().st_size == self.layout.nbytes:
                continue  # (saved by this or another engine)
            data = block.contiguous().view(torch.uint8).numpy().tobytes()
            aside = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
            try:
                aside.write_bytes(data)
                os.replace(aside, path)
            except OSError as exc:
                logger.warning("KV transfer: cannot write block %s: %s", path, exc)
                aside.unlink(missing_ok=True)
