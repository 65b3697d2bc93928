"""``LLMEngine``'s sleep mode (``--enable-sleep-mode``): between steps, every request is
aborted and every rank puts its weights and KV cache to sleep (:mod:`pagedllm.core.sleep`);
requests are refused until it is woken."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.request import RequestStatus

if TYPE_CHECKING:
    from pagedllm.core.outputs import RequestOutput

logger = logging.getLogger("pagedllm.engine")


class SleepMode:
    """The sleep-mode methods of :class:`~pagedllm.core.engine.LLMEngine` (whose
    ``sleep_level``, ``sleeping_tags`` and ``refusing_requests`` they keep)."""

    config: Any
    executor: Any
    kv_manager: Any
    output_processor: Any
    scheduler: Any
    sleep_level: int
    sleeping_tags: set[str]
    refusing_requests: bool

    drain_steps: Callable[[], list[Any]]

    def _check_sleep_mode(self) -> None:
        if not self.config.model_config.enable_sleep_mode:
            raise ConfigError(
                "sleep mode is off: start the engine with --enable-sleep-mode "
                "(LLM(..., enable_sleep_mode=True)) to put it to sleep and wake it up"
            )

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def refuse_requests(self) -> None:
        """Refuse new requests from now on (before sleeping once the running ones
        finish); :meth:`wake_up` takes them again."""
        self._check_sleep_mode()
        self.refusing_requests = True

    def sleep(self, level: int = 1) -> list[RequestOutput]:
        """Abort every unfinished request (their last outputs, finish reason ``abort``, are
        returned), drop the prefix cache and put every rank to sleep at ``level`` (1: the
        weights moved out of the device's memory, the KV cache dropped; 2: both dropped).
        Requests are refused until :meth:`wake_up`."""
        from pagedllm.core.sleep import SLEEP_TAGS, check_sleep_level

        self._check_sleep_mode()
        level = check_sleep_level(level)
        if self.is_sleeping:
            logger.warning("sleep: the engine is already asleep (level %d)", self.sleep_level)
            return []
        outputs, sequence_ids = self.output_processor.abort_all()
        self.scheduler.finish_requests(sequence_ids, RequestStatus.FINISHED_ABORTED)
        self.drain_steps()  # (steps in flight still write the KV cache)
        # (no block is in use now: the cache's contents are gone, so are its hashes)
        if not self.kv_manager.reset_prefix_cache():
            raise RuntimeError("sleep: KV blocks are still in use after aborting every request")
        try:
            self.executor.sleep(level)
        except BaseException:
            self.refusing_requests = False  # (still awake: it serves on)
            raise
        self.refusing_requests = True
        self.sleep_level = level
        self.sleeping_tags = set(SLEEP_TAGS)
        return outputs

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back what ``tags`` name (``weights``, ``kv_cache``; None: everything);
        whether the engine is fully awake (then it takes requests again)."""
        from pagedllm.core.sleep import check_wake_tags

        self._check_sleep_mode()
        tags = check_wake_tags(tags)
        waking = [t for t in (tags or sorted(self.sleeping_tags)) if t in self.sleeping_tags]
        if waking:
            self.executor.wake_up(waking)
            self.sleeping_tags -= set(waking)
        if not self.sleeping_tags:
            self.sleep_level = 0
            self.refusing_requests = False
        return not self.sleeping_tags
