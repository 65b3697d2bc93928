"""Physical KV-cache blocks, the LRU free queue and the prefix-cache map.

A block is free when no request holds it (``ref_cnt == 0``). A free block keeps its hash
so a later request can still hit it; the hash is dropped only when the block is reused
for new content (lazy eviction). Freed blocks are reused least recently freed first.

Which free block a request gets decides both the prefix cache's size and the memory the
process touches (the OS commits a KV block's pages at its first write). A never-touched
block is taken only while the freed blocks number no more than the most blocks ever held
at once (``peak_in_use``); past that, the least recently freed block is reused first. So
the prefix cache keeps the blocks of finished requests, least recently used evicted
first, up to about as many as the busiest moment so far held; a server touches about
twice its peak working set of KV memory, not its whole budget, however many distinct
prompts it has seen. A prefix hit takes its block back out of the free queue, so a
prefix in steady use stays cached. Without prefix caching freed blocks hold nothing
reusable and are always taken before untouched ones.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence

from pagedllm.core.kv_cache.events import KVEventLog
from pagedllm.core.kv_cache.hashing import BlockHash


@dataclasses.dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block. Compared by identity: the pool owns exactly one per id."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block holds a full, hashed block that is in the prefix-cache map.
    block_hash: BlockHash | None = None
    # Links of the free queue; both None while the block is not in it.
    prev_free: KVCacheBlock | None = dataclasses.field(default=None, repr=False)
    next_free: KVCacheBlock | None = dataclasses.field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks, head first evicted; O(1) everywhere.

    A ``deque`` cannot remove from the middle in O(1), which ``touch`` of a cached free
    block needs. Sentinel head and tail nodes keep the link updates branch-free.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Yield the free blocks in eviction order (next to be reused first)."""
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def popleft(self) -> KVCacheBlock:
        """Remove and return the block to evict next. Raises IndexError when empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free KV-cache blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block``, which must be in this queue."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail: it is evicted after every block already queued."""
        assert block.prev_free is None and block.next_free is None, "block already queued"
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1


class BlockPool:
    """All ``num_blocks`` blocks, their ref counts and (with caching) the hash->block map.

    Callers check ``get_num_free_blocks()`` before asking for blocks; asking for more than
    are free is a bug and raises. Free blocks are of two kinds: never touched (the ids from
    ``_next_untouched`` on, taken in order) and freed (``_freed``, the LRU queue); see the
    module docstring for which one ``get_new_blocks`` takes.
    """

    __slots__ = (
        "_freed",
        "_next_untouched",
        "blocks",
        "cached_block_hash_to_block",
        "enable_caching",
        "events",
        "peak_in_use",
    )

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, events: KVEventLog | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.enable_caching = enable_caching
        # Where the prefix cache's changes are recorded (KV-cache events), None: nowhere.
        self.events = events
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self._next_untouched = 0
        self._freed = FreeBlockQueue()
        # The most blocks held at once so far: how many freed blocks the cache keeps
        # before reusing them rather than touching new ones.
        self.peak_in_use = 0
        # One block per hash: a second block computed with the same content (two requests
        # prefilled it in the same step) stays unhashed and is simply reused when freed.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def free_block_queue(self) -> Iterator[KVCacheBlock]:
        """The free blocks: the never-touched ones, then the freed ones least recently
        freed first (the order they are taken in while the cache is under its size)."""
        return itertools.chain(self.blocks[self._next_untouched :], self._freed)

    def get_num_free_blocks(self) -> int:
        return self.num_blocks - self._next_untouched + self._freed.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by requests (0.0 to 1.0). Free cached blocks count as
        free: they are reclaimable at any time."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding ``block_hash``, free or in use, or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks, each returned with ``ref_cnt`` 1: a freed one
        (LRU) or a never-touched one, as the module docstring says.

        A taken block that still holds a hash is evicted from the prefix cache now.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} are free"
            )
        new_blocks = []
        for _ in range(num_blocks):
            untouched_left = self._next_untouched < self.num_blocks
            keep_freed = self.enable_caching and len(self._freed) <= self.peak_in_use
            if untouched_left and (keep_freed or not self._freed):
                block = self.blocks[self._next_untouched]
                self._next_untouched += 1
            else:
                block = self._freed.popleft()
                self.uncache_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            new_blocks.append(block)
        self._note_in_use()
        return new_blocks

    def _note_in_use(self) -> None:
        self.peak_in_use = max(self.peak_in_use, self.num_blocks - self.get_num_free_blocks())

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget ``block``'s hash (no-op when it has none); its content is untouched."""
        block_hash = block.block_hash
        if block_hash is None:
            return
        block.block_hash = None
        if self.cached_block_hash_to_block.get(block_hash) is block:
            del self.cached_block_hash_to_block[block_hash]
            if self.events is not None:
                self.events.removed(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                assert block.block_id < self._next_untouched, "touching a never-used block"
                self._freed.remove(block)
            block.ref_cnt += 1
        self._note_in_use()

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; a block reaching 0 joins the queue tail, so
        pass blocks in the order they should be evicted (first = evicted first)."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._freed.append(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Record hashes for ``blocks[num_cached_blocks:num_full_blocks]`` of one request.

        ``block_hashes[i]`` must be the chain hash of the request's i-th block. Blocks that
        already carry a hash (prefix hits) are left as they are.
        """
        if not self.enable_caching:
            return
        assert num_full_blocks <= len(blocks) and num_full_blocks <= len(block_hashes)
        # (With events: the first index of the run of blocks hashed here so far.)
        run_start = None
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            block_hash = block_hashes[index]
            if block.block_hash is not None or block_hash in self.cached_block_hash_to_block:
                assert block.block_hash in (None, block_hash), "block reused with other content"
                self._announce(block_hashes, run_start, index)
                run_start = None
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            if run_start is None:
                run_start = index
        self._announce(block_hashes, run_start, num_full_blocks)

    def _announce(self, block_hashes: Sequence[BlockHash], start: int | None, end: int) -> None:
        """Record ``block_hashes[start:end]`` as stored (a BlockStored event each run of
        consecutive blocks, chained on the block before it); None: nothing to record."""
        if self.events is not None and start is not None:
            parent = block_hashes[start - 1] if start > 0 else None
            self.events.stored(block_hashes[start:end], parent)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (returns False, changes nothing) while any block is
        in use, because a running request's blocks would lose their identity mid-flight."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.events is not None:
            self.events.cleared()
        return True
