"""Unit tests of the pure-Python KV-cache bookkeeping (no model, no torch)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from pagedllm.core.kv_cache import (
    BlockPool,
    FreeBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    get_hash_fn,
    hash_block_tokens,
    hash_request_tokens,
)
from pagedllm.core.request import Request

BS = 4  # block size used throughout


def make_request(
    request_id: str,
    tokens: list[int],
    cache_salt: str | None = None,
    prompt_logprobs: int | None = None,
    keep_kv_tail: bool = False,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        sampling_params=types.SimpleNamespace(
            prompt_logprobs=prompt_logprobs, keep_kv_tail=keep_kv_tail
        ),
        cache_salt=cache_salt,
    )


def prefill(manager: KVCacheManager, request: Request) -> int:
    """Schedule and 'run' the whole request as the engine would; return the hit tokens."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit_tokens


def free_ids(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_block_queue]


def snapshot(manager: KVCacheManager, requests: list[Request]) -> tuple:
    pool = manager.block_pool
    return (
        manager.num_free_blocks,
        [block.ref_cnt for block in pool.blocks],
        [block.block_hash for block in pool.blocks],
        free_ids(manager),
        dict(pool.cached_block_hash_to_block),
        {r.request_id: manager.get_block_ids(r.request_id) for r in requests},
        (manager.prefix_cache_stats.queries, manager.prefix_cache_stats.hits),
    )


def test_import_does_not_pull_torch() -> None:
    code = "import sys, pagedllm.core.kv_cache; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_blocks": 0, "block_size": 4}, "num_blocks"),
        ({"num_blocks": 4, "block_size": 0}, "block_size"),
        ({"num_blocks": 4, "block_size": 4, "hash_algo": "md5"}, "builtin.*sha256"),
    ],
)
def test_manager_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KVCacheManager(**kwargs)


def test_num_new_tokens_must_be_positive() -> None:
    manager = KVCacheManager(4, BS)
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(make_request("a", [1, 2]), 0)


def test_free_block_queue_order_and_remove() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue] == [0, 1, 2, 3] and queue.num_free_blocks == 4
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3] and len(queue) == 3
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 2, 0]
    for _ in range(4):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_block_pool_ref_counts() -> None:
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt, pool.get_num_free_blocks()) == (1, 1, 1)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a, b])
    assert (a.ref_cnt, b.ref_cnt, pool.get_num_free_blocks()) == (1, 0, 2)
    pool.free_blocks([a])
    assert [blk.block_id for blk in pool.free_block_queue] == [2, b.block_id, a.block_id]
    pool.touch([b])  # a free block taken back out of the queue
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    with pytest.raises(ValueError, match="only 2 are free"):
        pool.get_new_blocks(3)


def test_lru_eviction_order() -> None:
    manager = KVCacheManager(8, BS)
    a = make_request("a", list(range(12)))  # 3 blocks
    b = make_request("b", list(range(100, 108)))  # 2 blocks
    prefill(manager, a)
    prefill(manager, b)
    a_ids, b_ids = manager.get_block_ids("a"), manager.get_block_ids("b")
    manager.free(a)
    manager.free(b)
    # Never-used blocks first, then least recently freed; within a request, tail first.
    assert free_ids(manager) == [5, 6, 7, *reversed(a_ids), *reversed(b_ids)]
    # Four new blocks: the three never-used ones, then a's tail block.
    manager.allocate_slots(make_request("c", list(range(200, 216))), 16)
    assert free_ids(manager) == [a_ids[1], a_ids[0], *reversed(b_ids)]


@pytest.mark.parametrize("hash_algo", ["builtin", "sha256"])
def test_prefix_hit_while_first_request_is_live(hash_algo: str) -> None:
    manager = KVCacheManager(10, BS, hash_algo=hash_algo)
    a = make_request("a", list(range(10)))  # blocks 0, 1 full; block 2 partial
    assert prefill(manager, a) == 0
    b = make_request("b", [*range(8), 50, 51, 52])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 8
    assert [blk.block_id for blk in hits] == manager.get_block_ids("a")[:2]
    new_blocks = manager.allocate_slots(b, b.num_tokens - num_hit_tokens, hits)
    assert new_blocks is not None and len(new_blocks) == 1
    assert manager.get_block_ids("b")[:2] == manager.get_block_ids("a")[:2]
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    assert manager.num_free_blocks == 10 - 4


@pytest.mark.parametrize("hash_algo", ["builtin", "sha256"])
def test_prefix_hit_after_first_request_is_freed(hash_algo: str) -> None:
    manager = KVCacheManager(10, BS, hash_algo=hash_algo)
    a = make_request("a", list(range(9)))
    prefill(manager, a)
    a_ids = manager.get_block_ids("a")
    manager.free(a)
    assert manager.num_free_blocks == 10
    b = make_request("b", list(range(9)))
    assert prefill(manager, b) == 8
    assert manager.get_block_ids("b")[:2] == a_ids[:2]
    assert manager.num_free_blocks == 10 - 3
    assert a_ids[0] not in free_ids(manager) and a_ids[1] not in free_ids(manager)


def test_eviction_drops_hashes_lazily() -> None:
    manager = KVCacheManager(4, BS)
    a = make_request("a", list(range(9)))
    prefill(manager, a)
    manager.free(a)
    pool = manager.block_pool
    # Freed but not yet reused: still cached.
    assert all(pool.get_cached_block(h) is not None for h in a.block_hashes)
    big = make_request("big", list(range(50, 66)))
    manager.allocate_slots(big, 16)  # takes all 4 blocks, a's cached ones included
    assert all(pool.get_cached_block(h) is None for h in a.block_hashes)
    assert set(pool.cached_block_hash_to_block) == set(big.block_hashes)
    manager.free(big)
    assert manager.get_computed_blocks(make_request("a2", list(range(9)))) == ([], 0)


def test_partial_blocks_are_not_hashed() -> None:
    manager = KVCacheManager(10, BS)
    a = make_request("a", list(range(6)))  # one full block, one partial
    prefill(manager, a)
    blocks = manager.get_blocks("a")
    assert blocks[0].block_hash is not None and blocks[1].block_hash is None
    assert len(a.block_hashes) == 1
    _, num_hit_tokens = manager.get_computed_blocks(make_request("b", list(range(6))))
    assert num_hit_tokens == 4


def test_at_least_one_token_is_computed() -> None:
    manager = KVCacheManager(10, BS)
    prefill(manager, make_request("a", list(range(8))))
    # Everything is cached: the last block is dropped so the model computes something.
    hits, num_hit_tokens = manager.get_computed_blocks(make_request("b", list(range(8))))
    assert (len(hits), num_hit_tokens) == (1, 4)
    prefill(manager, make_request("c", list(range(9))))
    _, num_hit_tokens = manager.get_computed_blocks(make_request("d", list(range(9))))
    assert num_hit_tokens == 8


def test_refused_allocation_changes_nothing() -> None:
    manager = KVCacheManager(4, BS)
    a = make_request("a", list(range(12)))
    prefill(manager, a)
    manager.free(a)  # 4 free blocks, 3 of them cached
    b = make_request("b", list(range(20)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert (len(hits), num_hit_tokens) == (3, 12)
    before = snapshot(manager, [a, b])
    # 2 new blocks are needed and 4 are free, but touching the 3 free hits leaves only 1.
    assert manager.allocate_slots(b, 8, hits) is None
    assert snapshot(manager, [a, b]) == before
    # A running request that cannot grow: also no change.
    c = make_request("c", list(range(50, 54)))
    prefill(manager, c)
    c.append_output_token_ids([1])
    manager.allocate_slots(make_request("d", list(range(60, 72))), 12)
    before = snapshot(manager, [a, b, c])
    assert manager.num_free_blocks == 0
    assert manager.allocate_slots(c, 1) is None
    assert snapshot(manager, [a, b, c]) == before


def test_allocation_counts_free_hits_exactly() -> None:
    manager = KVCacheManager(4, BS)
    a = make_request("a", list(range(12)))
    prefill(manager, a)
    manager.free(a)
    b = make_request("b", list(range(16)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    new_blocks = manager.allocate_slots(b, b.num_tokens - num_hit_tokens, hits)
    assert new_blocks is not None and len(new_blocks) == 1
    assert manager.num_free_blocks == 0


def test_chain_hashing_depends_on_the_prefix() -> None:
    hash_fn = get_hash_fn("builtin")
    first = hash_request_tokens(hash_fn, BS, [1, 2, 3, 4, 5, 6, 7, 8])
    second = hash_request_tokens(hash_fn, BS, [9, 9, 9, 9, 5, 6, 7, 8])
    assert first[1].token_ids == second[1].token_ids and first[1] != second[1]
    manager = KVCacheManager(10, BS)
    prefill(manager, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    b = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert manager.get_computed_blocks(b) == ([], 0)
    assert manager.block_pool.get_cached_block(b.block_hashes[1]) is None


def test_hash_value_collision_is_not_a_hit() -> None:
    def constant_hash(_: object) -> int:
        return 7

    x = hash_block_tokens(constant_hash, None, [1, 2])
    y = hash_block_tokens(constant_hash, None, [3, 4])
    assert x.hash_value == y.hash_value and x != y and len({x, y}) == 2


def test_cache_salt_separates() -> None:
    manager = KVCacheManager(20, BS)
    tokens = list(range(9))
    prefill(manager, make_request("a", tokens, cache_salt="alice"))
    assert manager.get_computed_blocks(make_request("b", tokens))[1] == 0
    assert manager.get_computed_blocks(make_request("c", tokens, cache_salt="bob"))[1] == 0
    assert manager.get_computed_blocks(make_request("d", tokens, cache_salt="alice"))[1] == 8


def test_range_keys_separate_only_the_blocks_they_overlap() -> None:
    # Tokens 5..8 stand for an image (the same placeholder ids whatever the image): the
    # blocks over them are keyed by the image, the block before them is not.
    manager = KVCacheManager(20, BS)
    tokens = list(range(13))

    def with_image(request_id: str, key: str) -> Request:
        request = make_request(request_id, tokens)
        request.range_keys = ((5, 9, key),)
        return request

    prefill(manager, with_image("a", "image-a"))
    assert manager.get_computed_blocks(with_image("b", "image-b"))[1] == BS
    assert manager.get_computed_blocks(make_request("c", tokens))[1] == BS
    assert manager.get_computed_blocks(with_image("d", "image-a"))[1] == 12


def test_hash_functions() -> None:
    sha = get_hash_fn("sha256")
    assert sha((1, (2, 3), None)) == sha((1, (2, 3), None)) != sha((1, (2, 4), None))
    assert sha((1, (2, 3), None)).bit_length() > 64
    assert get_hash_fn("builtin")((1, 2)) == hash((1, 2))
    with pytest.raises(ValueError, match="md5"):
        get_hash_fn("md5")


def test_usage() -> None:
    manager = KVCacheManager(4, BS)
    assert manager.usage == 0.0
    a = make_request("a", list(range(8)))
    prefill(manager, a)
    assert manager.usage == 0.5
    manager.free(a)  # cached but free blocks are reclaimable: not in use
    assert manager.usage == 0.0


def test_reset_prefix_cache() -> None:
    manager = KVCacheManager(4, BS)
    a = make_request("a", list(range(9)))
    prefill(manager, a)
    before = snapshot(manager, [a])
    assert manager.reset_prefix_cache() is False
    assert snapshot(manager, [a]) == before
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_decode_tokens_fill_blocks_incrementally() -> None:
    manager = KVCacheManager(10, BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    prefill(manager, a)
    first_hash = a.block_hashes[0]
    for token in (7, 8, 9):  # sample a token, then schedule it as the next step does
        a.append_output_token_ids([token])
        assert manager.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    assert a.block_hashes[0] is first_hash  # extended, not recomputed
    assert a.block_hashes == hash_request_tokens(get_hash_fn("builtin"), BS, a.all_token_ids)
    assert manager.get_blocks("a")[1].block_hash == a.block_hashes[1]
    manager.free(a)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert manager.get_computed_blocks(b)[1] == 8


def test_uncomputed_blocks_leave_the_cache_on_free() -> None:
    manager = KVCacheManager(10, BS)
    a = make_request("a", list(range(9)))
    prefill(manager, a)
    b = make_request("b", [*range(8), *range(20, 29)])
    hits, _ = manager.get_computed_blocks(b)
    manager.allocate_slots(b, 9, hits)
    # b is preempted before its step ran (num_computed_tokens still 0): its own newly
    # hashed blocks were never written and must not be hit, but the hits stay cached.
    manager.free(b)
    c = make_request("c", [*range(8), *range(20, 29)])
    assert manager.get_computed_blocks(c)[1] == 8


def test_same_content_allocated_twice_in_one_step() -> None:
    manager = KVCacheManager(10, BS)
    a, b = make_request("a", list(range(9))), make_request("b", list(range(9)))
    hits_a, _ = manager.get_computed_blocks(a)
    hits_b, _ = manager.get_computed_blocks(b)
    manager.allocate_slots(a, 9, hits_a)
    manager.allocate_slots(b, 9, hits_b)
    a.num_computed_tokens = b.num_computed_tokens = 9
    assert all(block.block_hash is None for block in manager.get_blocks("b"))
    a_ids = manager.get_block_ids("a")
    manager.free(a)
    manager.free(b)
    hits, _ = manager.get_computed_blocks(make_request("c", list(range(9))))
    assert [block.block_id for block in hits] == a_ids[:2]


def test_prefix_cache_stats() -> None:
    manager = KVCacheManager(10, BS)
    prefill(manager, make_request("a", list(range(9))))
    manager.get_computed_blocks(make_request("b", list(range(11))))
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 20, 8)
    assert stats.hit_rate == pytest.approx(0.4)
    assert manager.take_prefix_cache_stats() is stats
    assert manager.prefix_cache_stats.queries == 0 and manager.prefix_cache_stats.hit_rate == 0.0
    manager.get_computed_blocks(make_request("c", list(range(9))))
    assert manager.prefix_cache_stats.queries == 9
    assert (manager.total_prefix_cache_stats.queries, manager.total_prefix_cache_stats.hits) == (
        29,
        16,
    )


def test_prompt_logprobs_and_disabled_caching_get_no_hits() -> None:
    manager = KVCacheManager(10, BS)
    prefill(manager, make_request("a", list(range(9))))
    b = make_request("b", list(range(9)), prompt_logprobs=0)
    assert manager.get_computed_blocks(b) == ([], 0)
    assert manager.prefix_cache_stats.requests == 1  # only "a" was counted
    plain = KVCacheManager(10, BS, enable_caching=False)
    c = make_request("c", list(range(9)))
    prefill(plain, c)
    assert plain.get_computed_blocks(make_request("d", list(range(9)))) == ([], 0)
    assert c.block_hashes == [] and plain.block_pool.cached_block_hash_to_block == {}
    assert plain.prefix_cache_stats.queries == 0


def test_misuse_is_refused() -> None:
    manager = KVCacheManager(10, BS)
    a = make_request("a", list(range(9)))
    prefill(manager, a)
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.get_computed_blocks(a)
    other = make_request("b", list(range(9)))
    hits, _ = manager.get_computed_blocks(other)
    with pytest.raises(ValueError, match="prefix hits"):
        manager.allocate_slots(a, 1, hits)
    assert manager.get_block_ids("nobody") == []
    manager.free(make_request("nobody", [1]))  # unknown request: no-op


def test_running_request_grows_only_when_needed() -> None:
    manager = KVCacheManager(10, BS)
    a = make_request("a", [1, 2, 3])
    prefill(manager, a)
    a.append_output_token_ids([4])
    assert manager.allocate_slots(a, 1) == []  # slot 4 fits the first block
    a.num_computed_tokens += 1
    a.append_output_token_ids([5])
    assert len(manager.allocate_slots(a, 1) or []) == 1
    assert len(manager.get_block_ids("a")) == 2


# ------------------------------------------------------------ partial tails (beam search)


def test_a_kept_tail_is_shared_copy_on_write():
    """A request with keep_kv_tail leaves its partial last block cached; requests that
    continue its tokens hit it (after the full blocks) and get a fresh block with a copy
    recorded, so the shared tail is never written; the copy's source stays referenced
    until the step ran."""
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_request("p", [1, 2, 3, 4, 5, 6], keep_kv_tail=True)
    prefill(manager, parent)
    full, tail = manager.get_block_ids("p")
    manager.free(parent)
    children = [make_request(f"c{t}", [1, 2, 3, 4, 5, 6, t]) for t in (7, 8)]
    for child in children:
        hits, num_hit_tokens = manager.get_computed_blocks(child)
        assert num_hit_tokens == 6 and [b.block_id for b in hits] == [full, tail]
        new_blocks = manager.allocate_slots(child, 1, hits)
        assert new_blocks is not None and len(new_blocks) == 1
        child.num_computed_tokens = 7
        assert manager.get_block_ids(child.request_id) == [full, new_blocks[0].block_id]
    copies = manager.take_block_copies()
    assert [source for source, _ in copies] == [tail, tail]
    destinations = {destination for _, destination in copies}
    assert len(destinations) == 2 and tail not in destinations
    assert manager.take_block_copies() == []
    assert manager.block_pool.blocks[tail].ref_cnt == 2  # (one per pending copy)
    manager.release_copy_sources()
    assert manager.block_pool.blocks[tail].ref_cnt == 0 and tail in free_ids(manager)
    # The tail stays cached for later continuations; a different continuation of the
    # full block misses it.
    assert manager.get_computed_blocks(make_request("again", [1, 2, 3, 4, 5, 6, 9]))[1] == 6
    assert manager.get_computed_blocks(make_request("other", [1, 2, 3, 4, 5, 7, 9]))[1] == 4
    for child in children:
        manager.free(child)


def test_tails_are_kept_only_when_asked_and_evicted_like_cached_blocks():
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    plain = make_request("plain", [1, 2, 3, 4, 5, 6])
    prefill(manager, plain)
    manager.free(plain)
    assert manager.get_computed_blocks(make_request("c", [1, 2, 3, 4, 5, 6, 7]))[1] == 4
    kept = make_request("kept", [1, 2, 3, 4, 5, 6], keep_kv_tail=True)
    prefill(manager, kept)
    manager.free(kept)
    assert manager.get_computed_blocks(make_request("c2", [1, 2, 3, 4, 5, 6, 7]))[1] == 6
    # Every block taken by another request: the tail's block is reused, the tail gone.
    hog = make_request("hog", list(range(100, 116)))
    prefill(manager, hog)
    assert manager.num_free_blocks == 0
    manager.free(hog)
    assert manager.get_computed_blocks(make_request("c3", [1, 2, 3, 4, 5, 6, 7]))[1] == 0
