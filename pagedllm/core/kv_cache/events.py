"""KV-cache events: what a KV-aware router learns of this engine's prefix cache.

The block pool records, when events are on, a ``BlockStored`` when full blocks enter the
prefix cache (their chain hashes, the hash of the block before the first one, their token
ids), a ``BlockRemoved`` when a cached block's hash is dropped (evicted, or unverified
after a preemption) and an ``AllBlocksCleared`` when the prefix cache is reset. The fields
and their order are vLLM's (``vllm.distributed.kv_events``, less the fields the core has no
value for), so a publisher turns them into vLLM's wire format field by field. A step
extension takes them (``KVCacheManager.take_events``) once per step (see
:meth:`~pagedllm.core.interfaces.extension.StepExtension.step_done`).

The hashes are pagedllm's prefix-cache hashes (not vLLM's): a router compares them for
equality and follows parent links only. One that fits in 64 bits is published as an int,
a sha256 one (``--prefix-caching-hash-algo sha256``) as its 32 bytes, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from pagedllm.core.kv_cache.hashing import BlockHash

logger = logging.getLogger("pagedllm.kv_cache")

ExternalBlockHash = int | bytes


def external_hash(hash_value: int) -> ExternalBlockHash:
    """A block's hash as events carry it: an int where msgpack holds it, else 32 bytes."""
    if -(2**63) <= hash_value < 2**64:
        return hash_value
    return hash_value.to_bytes(32, "big")


@dataclasses.dataclass(slots=True)
class BlockStored:
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    # (vLLM's other fields, where the blocks live and whose adapter wrote them, are the
    # publisher's to fill.)


@dataclasses.dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[ExternalBlockHash]


@dataclasses.dataclass(slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """The events recorded since the engine last took them, at most ``max_events`` (past
    that, further events are dropped and counted: a log nobody drains must not grow)."""

    __slots__ = ("block_size", "dropped", "events", "max_events")

    def __init__(self, block_size: int, max_events: int = 100_000) -> None:
        self.block_size = block_size
        self.max_events = max_events
        self.events: list[KVCacheEvent] = []
        self.dropped = 0

    def _add(self, event: KVCacheEvent) -> None:
        if len(self.events) < self.max_events:
            self.events.append(event)
        else:
            self.dropped += 1

    def stored(self, block_hashes: Sequence[BlockHash], parent: BlockHash | None) -> None:
        """Consecutive full blocks of one request entered the cache; ``parent``: the hash
        of the block before the first (None for a request's first block)."""
        self._add(
            BlockStored(
                block_hashes=[external_hash(h.hash_value) for h in block_hashes],
                parent_block_hash=None if parent is None else external_hash(parent.hash_value),
                token_ids=[t for h in block_hashes for t in h.token_ids],
                block_size=self.block_size,
            )
        )

    def removed(self, block_hash: BlockHash) -> None:
        """A cached block's hash was dropped. A partial block (a beam's cached tail) was
        never announced, so its removal is not either."""
        if len(block_hash.token_ids) == self.block_size:
            self._add(BlockRemoved(block_hashes=[external_hash(block_hash.hash_value)]))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first; warns once per call about drops."""
        events, self.events = self.events, []
        if self.dropped:
            logger.warning(
                "KV-cache events: %d events dropped (more than %d between two steps)",
                self.dropped,
                self.max_events,
            )
            self.dropped = 0
        return events
