"""Sleep mode (``--enable-sleep-mode``): one rank's weights and KV cache leave the device's
memory and come back, at the same addresses.

Level 1 writes the weights' bytes to a file in ``PAGEDLLM_SLEEP_DIR`` (default: the
system's temporary directory) before their memory is released, and reads them back on
waking; level 2 keeps nothing and, on waking, copies them from the model built again from
its checkpoint. The KV cache is dropped at both levels (its blocks are computed again).
Addresses are kept because kernels and decode graphs hold raw pointers to these tensors:
the device releases the memory behind them (:meth:`Device.release_memory`) rather than
freeing the tensors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

import torch

from pagedllm.core.errors import ConfigError

logger = logging.getLogger("pagedllm.sleep")

ENV_SLEEP_DIR = "PAGEDLLM_SLEEP_DIR"
# What is asleep, as vLLM's wake_up tags name it.
WEIGHTS, KV_CACHE = "weights", "kv_cache"
SLEEP_TAGS = (WEIGHTS, KV_CACHE)
SLEEP_LEVELS = (1, 2)


def check_sleep_level(level: Any) -> int:
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(
            f"sleep level {level!r} is not supported: 1 (weights moved out of the device's "
            "memory, KV cache dropped) or 2 (both dropped)"
        )
    return int(level)


def check_wake_tags(tags: Iterable[str] | None) -> list[str] | None:
    """``tags`` checked against :data:`SLEEP_TAGS` (None or empty: everything)."""
    if not tags:
        return None
    tags = list(tags)
    unknown = [t for t in tags if t not in SLEEP_TAGS]
    if unknown:
        raise ValueError(
            f"unknown wake_up tag {unknown[0]!r}; the tags are {', '.join(SLEEP_TAGS)} "
            "(none: wake everything)"
        )
    return tags


def named_storages(model: torch.nn.Module) -> dict[str, torch.UntypedStorage]:
    """Every storage the model's modules hold (parameters, buffers and tensor attributes,
    also within lists, tuples and dicts), once each, named by the first module path and
    attribute that holds it (the same names for the same model built twice)."""
    found: dict[str, torch.UntypedStorage] = {}
    seen: set[int] = set()

    def add(name: str, value: Any, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_meta or isinstance(value, torch.nn.Module):
                return
            storage = value.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                found[name] = storage
        elif depth < 2 and isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                add(f"{name}.{i}", item, depth + 1)
        elif depth < 2 and isinstance(value, dict):
            for key, item in value.items():
                add(f"{name}.{key}", item, depth + 1)

    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_buffers"):
                for key, tensor in value.items():
                    add(prefix + key, tensor, 1)
            elif attr != "_modules":
                add(prefix + attr, value)
    return found


class RankSleep:
    """One rank's sleep: ``model`` (and its tensors), ``kv_caches`` (the runner's),
    ``reload`` (the model built again from its checkpoint, for waking from level 2),
    ``reloadable`` (the names of :func:`named_storages` of the model as loaded, which
    ``reload`` builds again) and the ``device`` that releases the memory."""

    def __init__(
        self,
        device: Any,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        reload: Callable[[], torch.nn.Module],
        reloadable: set[str],
    ) -> None:
        self.device = device
        self.model = model
        self.kv_caches = kv_caches
        self.reload = reload
        self.reloadable = reloadable
        self.level = 0
        self.asleep: set[str] = set()
        self._saved: list[torch.UntypedStorage] = []
        self._dropped: dict[str, torch.UntypedStorage] = {}
        self._file: Any = None

    def _kv_storages(self) -> list[torch.UntypedStorage]:
        unique = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in self.kv_caches}
        return list(unique.values())

    def sleep(self, level: int) -> int:
        """Release the weights and the KV cache; the bytes released. At level 2 the
        storages a fresh load builds (``reloadable``) are dropped, and those built later
        (caches of the kernels, adapters' slots) are saved as at level 1."""
        level = check_sleep_level(level)
        if self.asleep:
            return 0
        weights = named_storages(self.model)
        if level == 1:
            saved, self._dropped = weights, {}
        else:
            saved = {k: v for k, v in weights.items() if k not in self.reloadable}
            self._dropped = {k: v for k, v in weights.items() if k in self.reloadable}
        self._saved = list(saved.values())
        directory = os.environ.get(ENV_SLEEP_DIR) or None
        try:
            self._file = tempfile.TemporaryFile(prefix="pagedllm-sleep-", dir=directory)
        except OSError as exc:
            raise ConfigError(
                f"sleep: cannot create the weights' file in {ENV_SLEEP_DIR}="
                f"{directory or tempfile.gettempdir()}: {exc}"
            ) from None
        try:
            released = self.device.release_memory(self._saved, self._file)
        except BaseException:
            self._close()
            raise
        released += self.device.release_memory(list(self._dropped.values()), None)
        released += self.device.release_memory(self._kv_storages(), None)
        self.level = level
        self.asleep = set(SLEEP_TAGS)
        logger.info("asleep (level %d): %.1f MiB released", level, released / 2**20)
        return released

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what ``tags`` name (None: everything asleep)."""
        for tag in [t for t in (tags or SLEEP_TAGS) if t in self.asleep]:
            if tag == WEIGHTS:
                self._wake_weights()
            else:
                # (what the dropped cache holds is never read: every block is written
                # again before attention reads it, the prefix cache having been reset)
                self.device.restore_memory(self._kv_storages(), None)
            self.asleep.discard(tag)
        if not self.asleep:
            self.level = 0

    def _wake_weights(self) -> None:
        if self._file is not None:  # (not yet restored by a wake that failed later)
            self._file.seek(0)
            self.device.restore_memory(self._saved, self._file)
            self._close()
        if not self._dropped:
            return
        fresh = named_storages(self.reload())
        self.device.restore_memory(list(self._dropped.values()), None)
        for name, storage in self._dropped.items():
            source = fresh.get(name)
            if source is None or source.nbytes() != storage.nbytes():
                raise RuntimeError(
                    f"wake_up: the model built again from its checkpoint has no {name!r} "
                    f"of {storage.nbytes()} bytes"
                )
            storage.copy_(source)
        self._dropped = {}

    def _close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
