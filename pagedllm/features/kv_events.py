"""KV-cache events (``--kv-events-config``) as a step extension: after each step it takes
the events the KV-cache manager recorded and hands them to the configured publisher, which
sends them on its own thread (a slow subscriber never holds the engine up).

Publishers: ``null`` (the events are taken and dropped), ``zmq`` (vLLM's ZeroMQ publisher,
:mod:`pagedllm.features.kv_event_publisher`, which needs pyzmq and msgspec: imported only
when chosen), or ``"module:Class"``, a class built as ``Class(config, data_parallel_rank)``
with ``publish(events)`` and ``shutdown()``.
"""

from __future__ import annotations

import importlib
from typing import Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.interfaces.extension import StepExtension

PUBLISHERS: dict[str, str | None] = {
    "null": None,
    "zmq": "pagedllm.features.kv_event_publisher:ZmqEventPublisher",
}


def publisher_class(name: str) -> type | None:
    """The publisher class ``name`` stands for (None: "null"); ConfigError naming the
    choices for an unknown one, or for "zmq" without its packages."""
    target = PUBLISHERS.get(name, name if ":" in name else "")
    if target is None:
        return None
    if not target:
        raise ConfigError(
            f"--kv-events-config publisher={name!r} is not a publisher; choose one of "
            f"{sorted(PUBLISHERS)} or a 'module:Class'"
        )
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"--kv-events-config publisher={name!r} needs {exc.name!r}, which is not "
            "installed: pip install 'pagedllm[kv-events]' (pyzmq and msgspec)"
        ) from exc
    try:
        return getattr(module, class_name)
    except AttributeError:
        raise ConfigError(
            f"--kv-events-config publisher={name!r}: {module_name} has no {class_name}"
        ) from None


class KVEventsExtension(StepExtension):
    """On with ``--kv-events-config '{"enable_kv_cache_events": true, ...}'``."""

    name = "kv_events"
    allows_steps_in_flight = True  # (it reads the one KV cache manager's events)

    def __init__(self, publisher_cls: type | None, config: Any, data_parallel_rank: int) -> None:
        super().__init__()
        self._publisher_cls = publisher_cls
        self._config = config
        self._rank = data_parallel_rank
        self.publisher: Any = None
        self._kv_manager: Any = None

    @classmethod
    def from_engine(cls, engine: Any) -> KVEventsExtension | None:
        config = engine.config.kv_events_config
        if config is None or not config.enable_kv_cache_events:
            return None
        rank = engine.config.parallel_config.data_parallel_rank
        return cls(publisher_class(config.publisher), config, rank)

    def kv_cache_ready(self, engine: Any, num_blocks: int) -> None:
        # (The sockets open once the engine is about to serve: a failed start leaves
        # no port bound.)
        self._kv_manager = engine.kv_manager
        self._kv_manager.record_events()
        if self._publisher_cls is not None:
            self.publisher = self._publisher_cls(self._config, self._rank)

    def step_done(self) -> None:
        events = self._kv_manager.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def shutdown(self) -> None:
        publisher, self.publisher = self.publisher, None
        if publisher is not None:
            publisher.shutdown()
