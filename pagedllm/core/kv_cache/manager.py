"""KVCacheManager: which physical blocks each request's tokens live in.

Pure Python (no torch) so the scheduler's bookkeeping is unit-tested in microseconds. The
scheduler uses it in this order for a request holding no blocks (new or preempted):

1. ``blocks, n = get_computed_blocks(request)``: prefix-cache hits, nothing reserved yet;
2. ``allocate_slots(request, num_new_tokens, blocks)``: reserves hits and new blocks, or
   returns ``None`` (nothing changed; preempt something or leave the request waiting);
3. after the step, ``request.num_computed_tokens += n + num_new_tokens``.

A running request only calls ``allocate_slots(request, num_new_tokens)``. ``free`` when it
finishes or is preempted.

Partial last blocks (beam search): a request whose ``sampling_params.keep_kv_tail`` is set
leaves its partial last block in the prefix cache when it is freed, hashed as a partial
block (its parent's chain hash and its tokens so far). A later request continuing those
tokens (a beam's children) finds it after its full-block hits and shares it copy-on-write:
its first write would land in that block, so ``allocate_slots`` gives it a fresh block and
records a copy (``take_block_copies``: ``(source, destination)`` ids), which the model runner
makes before the step's kernels. The source stays referenced until the step has run
(``release_copy_sources``). Such tails are free blocks like any cached one: evicted
(LRU) when blocks run short.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pagedllm.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedllm.core.kv_cache.events import KVCacheEvent, KVEventLog
from pagedllm.core.kv_cache.hashing import (
    HASH_ALGOS,
    BlockHash,
    HashFn,
    get_hash_fn,
    hash_block_tokens,
    request_extra_keys,
    update_request_block_hashes,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pagedllm.core.request import Request


@dataclasses.dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups: ``queries`` tokens looked up, ``hits`` of them found."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens


@dataclasses.dataclass(slots=True)
class _RequestBlocks:
    blocks: list[KVCacheBlock] = dataclasses.field(default_factory=list)
    # blocks[:num_cached_blocks] have been offered to the prefix cache already.
    num_cached_blocks: int = 0
    # blocks[:num_hit_blocks] came from prefix hits, so their KV is known to be computed.
    num_hit_blocks: int = 0


@dataclasses.dataclass(slots=True)
class KVCacheManager:
    """Allocates blocks of ``block_size`` token slots to requests, with prefix caching.

    ``request.block_hashes`` is filled lazily (on each call) with the chain hashes of the
    request's full blocks under this manager's ``block_size`` and ``hash_algo``.
    """

    num_blocks: int
    block_size: int
    enable_caching: bool = True
    hash_algo: str = "builtin"
    block_pool: BlockPool = dataclasses.field(init=False, repr=False)
    prefix_cache_stats: PrefixCacheStats = dataclasses.field(init=False, repr=False)
    total_prefix_cache_stats: PrefixCacheStats = dataclasses.field(init=False, repr=False)
    _hash_fn: HashFn = dataclasses.field(init=False, repr=False)
    _requests: dict[str, _RequestBlocks] = dataclasses.field(init=False, repr=False)
    # Block id of a cached partial tail -> its number of tokens.
    _tails: dict[int, int] = dataclasses.field(init=False, repr=False)
    # Copies for the coming step, and the tails they read (referenced until it ran).
    _copies: list[tuple[int, int]] = dataclasses.field(init=False, repr=False)
    _copy_sources: list[KVCacheBlock] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"unknown prefix-cache hash algorithm {self.hash_algo!r}; "
                f"choose one of {HASH_ALGOS}"
            )
        self.block_pool = BlockPool(self.num_blocks, self.enable_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self.total_prefix_cache_stats = PrefixCacheStats()
        self._hash_fn = get_hash_fn(self.hash_algo)
        self._requests = {}
        self._tails = {}
        self._copies = []
        self._copy_sources = []

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of ``request``'s tokens.

        Returns ``(blocks, len(blocks) * block_size)``. At least one token is always left
        to compute (the model must produce logits for the last one), so a fully cached
        request gets all but its last block. No references are taken: pass the blocks to
        ``allocate_slots`` in the same scheduling step, before any other allocation can
        evict them. Only for a request that holds no blocks.
        """
        if not self.enable_caching:
            return [], 0
        # Prompt logprobs need the logits at every prompt position.
        if getattr(request.sampling_params, "prompt_logprobs", None) is not None:
            return [], 0
        state = self._requests.get(request.request_id)
        if state is not None and state.blocks:
            raise ValueError(
                f"request {request.request_id!r} already holds blocks; "
                "prefix-cache lookups are for requests that hold none"
            )
        update_request_block_hashes(request, self.block_size, self._hash_fn)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_blocks.append(block)
        num_hit_tokens = len(hit_blocks) * self.block_size
        if self._tails:
            tail = self._find_tail(request, hit_blocks, request.num_tokens - 1 - num_hit_tokens)
            if tail is not None:
                hit_blocks.append(tail)
                num_hit_tokens += self._tails[tail.block_id]
        self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)
        self.total_prefix_cache_stats.record(request.num_tokens, num_hit_tokens)
        return hit_blocks, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        Slots are needed for ``request.num_computed_tokens + len(new_computed_blocks) *
        block_size + num_new_tokens`` tokens (``num_computed_tokens`` must not include the
        hits yet). Returns the newly allocated blocks (possibly empty), or ``None`` when
        too few blocks are free, in which case nothing at all has changed.

        On success, every block that is now full of known tokens is hashed into the
        prefix cache, even though its KV is only written by the coming step: the runner
        writes a step's KV before attention reads it, so a request that hits these blocks
        in the same step still sees correct values.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        computed = list(new_computed_blocks or ())
        state = self._requests.get(request.request_id)
        held = state.blocks if state is not None else []
        if computed and (held or request.num_computed_tokens):
            raise ValueError(
                f"request {request.request_id!r}: prefix hits can only start a request "
                "that holds no blocks and has no computed tokens"
            )
        # A partial tail among the hits is copied into the request's first new block.
        tail = computed.pop() if computed and computed[-1].block_id in self._tails else None
        tail_tokens = self._tails[tail.block_id] if tail is not None else 0
        num_tokens_with_slots = (
            request.num_computed_tokens
            + len(computed) * self.block_size
            + tail_tokens
            + num_new_tokens
        )
        num_required_blocks = -(-num_tokens_with_slots // self.block_size)
        num_new_blocks = max(0, num_required_blocks - len(held) - len(computed))
        # A hit block sitting in the free queue stops being free once touched.
        hits = computed if tail is None else [*computed, tail]
        num_free_hits = sum(1 for block in hits if block.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.block_pool.get_num_free_blocks():
            return None

        if state is None:
            state = self._requests[request.request_id] = _RequestBlocks()
        if computed:
            self.block_pool.touch(computed)
            state.blocks.extend(computed)
            state.num_hit_blocks = state.num_cached_blocks = len(computed)
        if tail is not None:
            # (Referenced until the copy has run: it cannot be handed out meanwhile.)
            self.block_pool.touch([tail])
            self._copy_sources.append(tail)
        new_blocks = self._new_blocks(num_new_blocks)
        if tail is not None:
            self._copies.append((tail.block_id, new_blocks[0].block_id))
        state.blocks.extend(new_blocks)

        if self.enable_caching:
            update_request_block_hashes(request, self.block_size, self._hash_fn)
            num_full_blocks = min(num_tokens_with_slots, request.num_tokens) // self.block_size
            if num_full_blocks > state.num_cached_blocks:
                self.block_pool.cache_full_blocks(
                    state.blocks, request.block_hashes, state.num_cached_blocks, num_full_blocks
                )
                state.num_cached_blocks = num_full_blocks
        return new_blocks

    def free(self, request: Request) -> None:
        """Release ``request``'s blocks and forget it (no-op for an unknown request).

        Call it BEFORE resetting ``request.num_computed_tokens`` on preemption: blocks
        this request hashed beyond its computed tokens never got their KV written, so they
        leave the prefix cache here; the rest stay cached until evicted. Blocks are freed
        tail first, so a request's private tail is evicted before its (likely shared)
        prefix.
        """
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return
        if self.enable_caching:
            first_unverified = max(
                request.num_computed_tokens // self.block_size, state.num_hit_blocks
            )
            for block in state.blocks[first_unverified : state.num_cached_blocks]:
                self.block_pool.uncache_block(block)
            if getattr(request.sampling_params, "keep_kv_tail", False):
                self._cache_tail(request, state)
        self.block_pool.free_blocks(reversed(state.blocks))

    def _cache_tail(self, request: Request, state: _RequestBlocks) -> None:
        """Hash ``request``'s partial last block of computed tokens into the prefix cache
        (as a partial block), for the requests that continue it."""
        full, partial = divmod(request.num_computed_tokens, self.block_size)
        if partial == 0 or len(state.blocks) <= full:
            return
        block = state.blocks[full]
        if block.block_hash is not None or block.block_id in self._tails:
            return
        update_request_block_hashes(request, self.block_size, self._hash_fn)
        parent = request.block_hashes[full - 1].hash_value if full else None
        start = full * self.block_size
        tail_hash = hash_block_tokens(
            self._hash_fn,
            parent,
            request.all_token_ids[start : start + partial],
            request_extra_keys(request, start, start + partial),
        )
        if self.block_pool.get_cached_block(tail_hash) is not None:
            return
        block.block_hash = tail_hash
        self.block_pool.cached_block_hash_to_block[tail_hash] = block
        self._tails[block.block_id] = partial

    def _find_tail(
        self, request: Request, hits: list[KVCacheBlock], max_tokens: int
    ) -> KVCacheBlock | None:
        """The longest cached partial tail continuing ``hits`` with ``request``'s next
        tokens (at most ``max_tokens`` of them, fewer than a block)."""
        start = len(hits) * self.block_size
        parent = request.block_hashes[len(hits) - 1].hash_value if hits else None
        tokens = request.all_token_ids
        for count in range(min(max_tokens, self.block_size - 1), 0, -1):
            extra_keys = request_extra_keys(request, start, start + count)
            tail_hash: BlockHash = hash_block_tokens(
                self._hash_fn, parent, tokens[start : start + count], extra_keys
            )
            block = self.block_pool.get_cached_block(tail_hash)
            if block is not None and self._tails.get(block.block_id) == count:
                return block
        return None

    def _new_blocks(self, count: int) -> list[KVCacheBlock]:
        """``count`` blocks from the pool; a cached tail among them stops being one."""
        blocks = self.block_pool.get_new_blocks(count)
        if self._tails:
            for block in blocks:
                self._tails.pop(block.block_id, None)
        return blocks

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The ``(source, destination)`` block copies the coming step needs first."""
        copies, self._copies = self._copies, []
        return copies

    def release_copy_sources(self) -> None:
        """Drop the references that kept the last step's copy sources (call once that
        step has run)."""
        if self._copy_sources:
            self.block_pool.free_blocks(self._copy_sources)
            self._copy_sources = []

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block table as blocks (a copy; empty for an unknown request)."""
        state = self._requests.get(request_id)
        return list(state.blocks) if state is not None else []

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: physical block ids in token order."""
        state = self._requests.get(request_id)
        return [block.block_id for block in state.blocks] if state is not None else []

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes; False (nothing done) while any block is in use."""
        done = self.block_pool.reset_prefix_cache()
        if done:
            self._tails.clear()
        return done

    def record_events(self) -> None:
        """From now on, record the prefix cache's changes as KV-cache events (see
        :meth:`take_events`): called by whoever publishes them, before any request."""
        if self.block_pool.events is None:
            self.block_pool.events = KVEventLog(self.block_size)

    def take_events(self) -> list[KVCacheEvent]:
        """The KV-cache events since the last call, oldest first (none when they are off)."""
        events = self.block_pool.events
        return events.take() if events is not None else []

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """Return the counts since the last call and start a new interval."""
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats
