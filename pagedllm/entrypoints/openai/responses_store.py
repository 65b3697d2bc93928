"""The Responses API's memory: stored responses (``store=true``, the default) by id, for
``GET /v1/responses/{id}``, ``previous_response_id`` and background work.

In memory and bounded: the store holds at most ``PAGEDLLM_RESPONSES_STORE_MB`` MiB
(default 64) of responses and their conversations, measured as JSON; when a new one
would pass that, the least recently used finished ones are dropped. Nothing survives a
restart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections import OrderedDict
from typing import Any

from pagedllm.core.env import env_number

logger = logging.getLogger("pagedllm.server")

STORE_SIZE_VARIABLE = "PAGEDLLM_RESPONSES_STORE_MB"
DEFAULT_STORE_MB = 64

# A response is finished (its work done) in these states.
FINISHED = frozenset({"completed", "incomplete", "failed", "cancelled"})


def store_limit_bytes() -> int:
    """The store's bound, from ``PAGEDLLM_RESPONSES_STORE_MB``."""
    megabytes = env_number(
        STORE_SIZE_VARIABLE,
        float(DEFAULT_STORE_MB),
        "a size in MiB (0 or more)",
        parse=float,
        minimum=0.0,
    )
    return int(megabytes * (1 << 20))


@dataclasses.dataclass
class StoredResponse:
    """A response as last reported, the conversation that continues from it (its input
    and output as chat messages), and, while a background response runs, its task."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    task: asyncio.Task[None] | None = None
    size: int = 0

    @property
    def finished(self) -> bool:
        return self.response["status"] in FINISHED


class ResponseStore:
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(
        self,
        response: dict[str, Any],
        conversation: list[dict[str, Any]],
        task: asyncio.Task[None] | None = None,
    ) -> None:
        """Store (or replace) ``response`` under its id."""
        self.remove(response["id"])
        entry = StoredResponse(response, conversation, task)
        entry.size = len(json.dumps([response, conversation], ensure_ascii=False))
        if entry.size > self.limit_bytes:
            logger.warning(
                "response %s is not stored: its %d bytes exceed the store's %d (%s)",
                response["id"],
                entry.size,
                self.limit_bytes,
                STORE_SIZE_VARIABLE,
            )
            return
        self._entries[response["id"]] = entry
        self._bytes += entry.size
        self._evict()

    def update(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """A running response's new state (nothing if it was deleted meanwhile)."""
        entry = self._entries.get(response["id"])
        if entry is None:
            return
        entry.response, entry.conversation = response, conversation
        size = len(json.dumps([response, conversation], ensure_ascii=False))
        self._bytes += size - entry.size
        entry.size = size
        self._evict()

    def remove(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry

    def _evict(self) -> None:
        # (Running responses stay: their task reports to them.)
        for response_id in [rid for rid, entry in self._entries.items() if entry.finished]:
            if self._bytes <= self.limit_bytes:
                return
            self.remove(response_id)
