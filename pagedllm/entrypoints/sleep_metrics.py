"""vLLM's ``engine_sleep_state`` gauge (sleep mode): one sample per ``sleep_state``
(``awake``, ``weights_offloaded``: asleep at level 1, ``discard_all``: at level 2), 1 for
the engine's state and 0 for the others. Registered as ``pagedllm:engine_sleep_state`` in
the server's metrics, which ``--metrics-prefix vllm`` exports under vLLM's name with its
``engine`` label (:mod:`pagedllm.entrypoints.metrics`)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Gauge

SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


class SleepStateGauge:
    def __init__(self, registry: Any, model_name: str) -> None:
        self.model_name = model_name
        self.gauge = Gauge(
            "pagedllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine "
            "is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means "
            "sleep level 2.",
            ["model_name", "sleep_state"],
            registry=registry,
        )
        self.record(0)

    def record(self, level: int) -> None:
        """The engine is awake (``level`` 0) or asleep at ``level``."""
        current = SLEEP_STATES[level]
        for state in SLEEP_STATES:
            self.gauge.labels(self.model_name, state).set(int(state == current))
