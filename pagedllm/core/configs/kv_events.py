"""--kv-events-config: publishing the KV cache's block events (vLLM's ``KVEventsConfig``).

The keys and defaults are vLLM's, so a router's deployment file works unchanged. The core
only records the events (see :mod:`pagedllm.core.kv_cache.events`); which publisher sends
them, and how, is the business of the step extension that drains them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedllm.core.configs.base import Config, format_value, setting
from pagedllm.core.errors import ConfigError

_FLAG = "--kv-events-config"


@dataclasses.dataclass
class KVEventsConfig(Config):
    # Record BlockStored / BlockRemoved / AllBlocksCleared events and publish them.
    enable_kv_cache_events: bool = False
    # A registered publisher's name ("null" or "zmq"); unset: "zmq" when events are on.
    publisher: str | None = None
    # Where the publisher's PUB socket binds ("*" in it) or connects; a data-parallel
    # replica adds its rank to the port.
    endpoint: str = "tcp://*:5557"
    # Where a late subscriber asks for past batches by sequence number (None: no replay).
    replay_endpoint: str | None = None
    # How many past batches the replay endpoint keeps.
    buffer_steps: int = setting(10_000, min=1)
    # The PUB socket's high-water mark: messages past it are dropped for a slow subscriber.
    hwm: int = setting(100_000, min=0)
    # Batches waiting for the publisher's thread; past it, new batches are dropped.
    max_queue_size: int = setting(100_000, min=1)
    # The first frame of every message (subscribers filter on it).
    topic: str = ""

    @classmethod
    def flag(cls, name: str) -> str:
        return f"{_FLAG} {name}"

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVEventsConfig:
        """The config of a ``--kv-events-config`` JSON object (unknown keys refused)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{_FLAG}: unknown key(s) {unknown} (known: {sorted(known)})")
        return cls(**values)

    def check(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError(
                f"{_FLAG}: enable_kv_cache_events="
                f"{format_value(self.enable_kv_cache_events)} must be true or false"
            )
        for name in ("endpoint", "topic", "publisher", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{_FLAG}: {name}={format_value(value)} must be a string")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{_FLAG}: {name}={format_value(value)} must be an integer")
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
